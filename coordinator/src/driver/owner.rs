//! The driver's owner (ADR 0043): one task holds every piece of the
//! driver's leader-local state and applies the messages of one channel to
//! it, one at a time. Nothing else reads or writes that state, so no lock
//! guards it.
//!
//! - A question carries a oneshot for its answer ([`Mailbox::ask`]); a
//!   message that needs none is a plain unbounded send ([`Mailbox::tell`]),
//!   which never waits, so it can be sent from a `Drop`.
//! - A mark that says "work runs here" is a value whose drop tells the owner
//!   that the work ended, whatever ended it: a mark cannot outlive the work.
//! - The owner never waits for I/O: it changes its data, answers, and
//!   starts the tasks that do the I/O (a grouped message's sender).

use std::sync::Arc;
use std::time::Duration;

use dtx_common::trace::TraceContext;
use dtx_proto::v1 as pb;
use dtx_tls::logtext::Clean;
use tokio::sync::mpsc;
use tokio::sync::oneshot;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::info;
use tracing::warn;

use super::answer::DeliveryError;
use super::book::AckReply;
use super::book::Attempt;
use super::book::Book;
use super::book::DeliveryAttempts;
use super::book::ErrorClass;
use super::book::FirstAnswer;
use super::book::Key;
use super::book::PrepareItem;
use super::book::RedriveReport;
use super::book::Settings;
use super::book::Step;
use super::book::Work;
use super::book::ANSWERED_ADDRESSES_MAX;
use super::group::Answer;
use super::group::Waiting;
use super::health;
use super::txids::Begin;
use super::txids::InFlightView;
use super::txids::Reserve;
use crate::ctx::now_ms;
use crate::sm::tally::Vote;
use crate::sm::Command;
use crate::sm::Outcome;
use crate::sm::Txid;

/// A delivery attempt's answer (one item of an ApplyDecisions message).
pub(super) type DecisionAnswer = Answer<Result<(), DeliveryError>>;

/// Which grouped message a queue feeds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// PrepareMany (`prepare_group`).
    Prepares,
    /// ApplyDecisions (`phase_two`).
    Decisions,
}

/// What the owner is told or asked.
pub(super) enum Msg {
    // Marks: which transactions have a task here.
    /// Marks `txid` as having a task of `work` here: the answer is the
    /// mark, or `None` if another task has it.
    Mark {
        work: Work,
        txid: Txid,
        reply: oneshot::Sender<Option<TaskMark>>,
    },
    /// A mark was dropped.
    Unmark { work: Work, txid: Txid },
    /// Work on `txid` saw its recorded decision.
    SawDecision { txid: Txid, outcome: Outcome },

    // Trace contexts.
    /// Keep `ctx` as the trace of `txid`'s participant calls.
    NoteTrace { txid: Txid, ctx: TraceContext },
    /// The trace kept for `txid`.
    TraceOf {
        txid: Txid,
        reply: oneshot::Sender<Option<TraceContext>>,
    },

    // Participant addresses.
    /// `addr` answered a call.
    Answered { addr: String },
    /// How many addresses are failing.
    Failing { reply: oneshot::Sender<usize> },

    // Phase two.
    /// A delivery asks for its next step (answered now or, parked, later).
    NextTurn {
        key: Key,
        addr: String,
        retried: health::Retried,
        reply: oneshot::Sender<Step>,
    },
    /// A delivery reports the call it was given `Go` for.
    Report { key: Key, attempt: Attempt, u: f64 },
    /// An attempt to show (a one-phase commit's call, an ack not recorded).
    NoteAttempt {
        key: Key,
        error: Option<(ErrorClass, String)>,
        next_in: Option<Duration>,
    },
    /// The attempts of `key` stop being shown.
    ForgetAttempts { key: Key },
    /// A delivery ended (its mark was dropped).
    DeliveryEnded { key: Key },
    /// The attempts of these participants.
    Attempts {
        keys: Vec<Key>,
        reply: oneshot::Sender<Vec<Option<DeliveryAttempts>>>,
    },
    /// A new term: every parked delivery looks again.
    WakeAll,
    /// An ack to propose with the others that come within
    /// `txn.ack_batch_wait_ms`.
    Ack { cmd: Command, reply: AckReply },

    // The leader loop.
    /// Picks this round's deliveries and re-drives among these (ascending).
    Pick {
        undelivered: Vec<Txid>,
        preparing: Vec<Txid>,
        reply: oneshot::Sender<(Vec<Txid>, Vec<Txid>)>,
    },
    /// A re-drive ended (`failed`: without a decision).
    RedriveEnded {
        txid: Txid,
        failed: bool,
        one_phase: Option<(String, String)>,
        u: f64,
        reply: oneshot::Sender<RedriveReport>,
    },

    // Grouped messages.
    /// Queue a prepare for its address's next PrepareMany.
    Prepare {
        addr: String,
        item: PrepareItem,
        reply: oneshot::Sender<Answer<Vote>>,
    },
    /// Queue a decision for its address's next ApplyDecisions.
    Decision {
        addr: String,
        item: pb::DecisionItem,
        reply: oneshot::Sender<DecisionAnswer>,
    },
    /// The PrepareMany sender of `addr` takes its next message, with the
    /// decisions that ride along (ADR 0030).
    TakePrepares {
        addr: String,
        reply: oneshot::Sender<PrepareBatch>,
    },
    /// The ApplyDecisions sender of `addr` takes its next message.
    TakeDecisions {
        addr: String,
        reply: oneshot::Sender<DecisionBatch>,
    },
    /// The sender `sender` of `addr` ended before its queue was empty.
    SenderGone { kind: Kind, addr: String, sender: u64 },

    // The one-write path (`fast`).
    /// A BeginAndCommit in `term` takes a txid, registers its key and
    /// keeps its trace.
    FastBegin {
        key: String,
        fingerprint: [u8; 32],
        term: u64,
        view: Arc<InFlightView>,
        trace: Option<TraceContext>,
        reply: oneshot::Sender<Begun>,
    },
    /// A BeginAndCommit's mark was dropped.
    FastEnd { key: String, txid: Txid, keep: bool },
    /// Which of `txids` are PENDING here in `term`.
    FastInFlight {
        txids: Vec<Txid>,
        term: u64,
        reply: oneshot::Sender<Vec<bool>>,
    },
    /// What Status shows of `txid` in flight here in `term`.
    FastView {
        txid: Txid,
        term: u64,
        reply: oneshot::Sender<Option<Arc<InFlightView>>>,
    },
    /// The leader loop's care in `term`: this term's in-flight txids, and
    /// whether to reserve ahead.
    FastHousekeeping {
        term: u64,
        reply: oneshot::Sender<(Vec<Txid>, bool)>,
    },
    /// These in-flight txids are recorded.
    FastRecorded { txids: Vec<Txid> },
    /// May this caller reserve a range for `term`?
    Reserve {
        term: u64,
        ahead: bool,
        reply: oneshot::Sender<Reserving>,
    },
    /// The reservation for `term` ended (its mark was dropped).
    Reserved { term: u64, range: Option<(Txid, Txid)> },
    /// `addr` answered UNIMPLEMENTED to the grouped message of `kind`.
    SingleCalls { kind: Kind, addr: String },
    /// `addr` ignored the decisions riding in a PrepareMany.
    NoRiders { addr: String },
}

/// A PrepareMany sender's next message: its prepares, and the decisions
/// riding along. `alone`: the address takes single calls (answer each
/// item `SendAlone`).
pub(super) struct PrepareBatch {
    pub items: Vec<Waiting<PrepareItem, Vote>>,
    pub riders: Vec<Waiting<pb::DecisionItem, Result<(), DeliveryError>>>,
    pub alone: bool,
    /// The trace kept for each item's transaction, then each rider's.
    pub traces: Vec<(Txid, Option<TraceContext>)>,
}

/// An ApplyDecisions sender's next message (`alone` as above).
pub(super) struct DecisionBatch {
    pub items: Vec<Waiting<pb::DecisionItem, Result<(), DeliveryError>>>,
    pub alone: bool,
    /// The trace kept for each item's transaction.
    pub traces: Vec<(Txid, Option<TraceContext>)>,
}

/// The owner's address: cheap to clone.
#[derive(Clone)]
pub(super) struct Mailbox(mpsc::UnboundedSender<Msg>);

impl Mailbox {
    /// Tells the owner `msg`; never waits (the owner is gone only when the
    /// driver is).
    pub fn tell(&self, msg: Msg) {
        let _ = self.0.send(msg);
    }

    /// Asks the owner; `None` if it is gone.
    pub async fn ask<T>(&self, msg: impl FnOnce(oneshot::Sender<T>) -> Msg) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        self.0.send(msg(tx)).ok()?;
        rx.await.ok()
    }
}

/// Held by a sender task: if the task ends before its queue is empty (it
/// panicked or was cancelled), the owner drops the queue's items (their
/// callers see no answer) and the next item starts a new sender.
pub(super) struct SenderMark {
    mailbox: Mailbox,
    kind: Kind,
    addr: String,
    sender: u64,
    armed: bool,
}

impl SenderMark {
    /// The queue is empty and gone: nothing to tell.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for SenderMark {
    fn drop(&mut self) {
        if self.armed {
            self.mailbox.tell(Msg::SenderGone {
                kind: self.kind,
                addr: std::mem::take(&mut self.addr),
                sender: self.sender,
            });
        }
    }
}

/// Marks a transaction as having a task of one kind on this node until
/// dropped: whatever ends the task (done, failed, panicked, cancelled),
/// the owner hears of it, so a mark cannot outlive the work (one left
/// behind would stop the leader loop from ever starting that work again).
/// Only the owner makes them, as its answer to [`Msg::Mark`]: an answer
/// that never reaches its asker drops its mark too.
pub(super) struct TaskMark {
    mailbox: Mailbox,
    work: Work,
    txid: Txid,
}

impl Drop for TaskMark {
    fn drop(&mut self) {
        self.mailbox.tell(Msg::Unmark {
            work: self.work,
            txid: self.txid,
        });
    }
}

/// Held by one participant's delivery: when it ends, however it ends, its
/// attempts stop being shown, a call it had out frees its slot and a
/// probe turn it held passes on.
pub(super) struct DeliveryMark {
    mailbox: Mailbox,
    key: Key,
}

impl DeliveryMark {
    pub fn new(mailbox: &Mailbox, key: Key) -> DeliveryMark {
        DeliveryMark {
            mailbox: mailbox.clone(),
            key,
        }
    }

    pub fn key(&self) -> &Key {
        &self.key
    }
}

impl Drop for DeliveryMark {
    fn drop(&mut self) {
        self.mailbox.tell(Msg::DeliveryEnded {
            key: std::mem::take(&mut self.key),
        });
    }
}

/// The owner's answer to `Msg::FastBegin`.
pub(super) enum Begun {
    /// This call drives: its mark holds its key and txid.
    Drive(FastMark),
    Waiting {
        fingerprint: [u8; 32],
        done: watch::Receiver<()>,
    },
    NoTxid,
}

/// The owner's answer to `Msg::Reserve`.
pub(super) enum Reserving {
    NotNeeded,
    Go(ReserveMark),
    Wait(oneshot::Receiver<()>),
}

/// A BeginAndCommit's hold on its key and txid: dropped, it tells the
/// owner to take them back (its txid stays in flight, PENDING, when
/// `keep`: its write may still be applied).
pub(super) struct FastMark {
    mailbox: Mailbox,
    key: String,
    pub txid: Txid,
    /// The txid stays in flight when the mark goes (its write may apply).
    pub keep: bool,
}

impl FastMark {
    pub(super) fn new(mailbox: Mailbox, key: String, txid: Txid) -> FastMark {
        FastMark {
            mailbox,
            key,
            txid,
            keep: false,
        }
    }
}

impl Drop for FastMark {
    fn drop(&mut self) {
        self.mailbox.tell(Msg::FastEnd {
            key: std::mem::take(&mut self.key),
            txid: self.txid,
            keep: self.keep,
        });
    }
}

/// The one `ReserveTxids` out: dropped, it tells the owner the range it
/// got (none if it failed), and the waiters go on.
pub(super) struct ReserveMark {
    mailbox: Mailbox,
    term: u64,
    /// The range reserved, `[first, end)` (none: the write failed).
    pub range: Option<(Txid, Txid)>,
}

impl ReserveMark {
    pub(super) fn new(mailbox: Mailbox, term: u64) -> ReserveMark {
        ReserveMark {
            mailbox,
            term,
            range: None,
        }
    }
}

impl Drop for ReserveMark {
    fn drop(&mut self) {
        self.mailbox.tell(Msg::Reserved {
            term: self.term,
            range: self.range,
        });
    }
}

/// The I/O the owner starts: the driver runs each in a task of its own.
pub(super) enum Start {
    /// The sender of `addr`'s PrepareMany messages, with its first one.
    Prepares {
        addr: String,
        first: PrepareBatch,
        mark: SenderMark,
    },
    /// The sender of `addr`'s ApplyDecisions messages.
    Decisions { addr: String, mark: SenderMark },
    /// The proposal of these acks, together.
    Acks(Vec<(Command, AckReply)>),
}

/// How the owner starts I/O (given by the driver, which it holds weakly).
pub(super) type Starter = Box<dyn Fn(Start) + Send>;

/// The owner task.
pub(super) struct Owner {
    book: Book,
    /// When the waiting acks go (`txn.ack_batch_wait_ms` after the first).
    acks_due: Option<Instant>,
    inbox: mpsc::UnboundedReceiver<Msg>,
    /// Its own address, for the marks it hands out (weak: the owner ends
    /// once the driver and every mark are gone).
    mailbox: mpsc::WeakUnboundedSender<Msg>,
    /// Starts the tasks that do I/O.
    start: Starter,
}

impl Owner {
    /// The owner of `driver` (not started), and its address.
    pub fn new(start: Starter, settings: Settings) -> (Owner, Mailbox) {
        let (tx, rx) = mpsc::unbounded_channel();
        let owner = Owner {
            book: Book::new(settings),
            acks_due: None,
            inbox: rx,
            mailbox: tx.downgrade(),
            start,
        };
        (owner, Mailbox(tx))
    }

    /// Applies every message, in order, until the driver is gone; sends
    /// the waiting acks when they are due.
    pub async fn run(mut self) {
        loop {
            let msg = match self.acks_due {
                Some(due) => tokio::select! {
                    msg = self.inbox.recv() => msg,
                    _ = tokio::time::sleep_until(due) => {
                        self.send_acks();
                        continue;
                    }
                },
                None => self.inbox.recv().await,
            };
            let Some(msg) = msg else { return };
            self.apply(msg, Instant::now());
        }
    }

    fn apply(&mut self, msg: Msg, now: Instant) {
        let clock = (now, now_ms());
        let book = &mut self.book;
        match msg {
            Msg::Mark { work, txid, reply } => {
                let mark = match (book.mark(work, txid), self.mailbox.upgrade()) {
                    (true, Some(tx)) => Some(TaskMark {
                        mailbox: Mailbox(tx),
                        work,
                        txid,
                    }),
                    (true, None) => {
                        book.unmark(work, txid);
                        None
                    }
                    (false, _) => None,
                };
                // An answer that finds no asker drops its mark: unmarked.
                let _ = reply.send(mark);
            }
            Msg::Unmark { work, txid } => book.unmark(work, txid),
            Msg::SawDecision { txid, outcome } => book.saw_decision(txid, outcome),
            Msg::NoteTrace { txid, ctx } => book.note_trace(txid, ctx),
            Msg::TraceOf { txid, reply } => {
                let _ = reply.send(book.trace(txid));
            }
            Msg::Answered { addr } => {
                if book.note_answered(&addr) == FirstAnswer::Full {
                    warn!(
                        "{ANSWERED_ADDRESSES_MAX} participant addresses have answered this node: from now on none is \
                         given up (txn.never_answered_give_up_ms no longer applies until a restart)"
                    );
                }
            }
            Msg::Failing { reply } => {
                let _ = reply.send(book.failing());
            }
            Msg::NextTurn {
                key,
                addr,
                retried,
                reply,
            } => book.next_turn(key, &addr, retried, clock, reply),
            Msg::Report { key, attempt, u } => {
                let pid = key.1.clone();
                if let Some((addr, event)) = book.report(key, attempt, u, clock) {
                    log_peer_event(&pid, &addr, event);
                }
            }
            Msg::NoteAttempt { key, error, next_in } => book.note_attempt(key, error, next_in, clock),
            Msg::ForgetAttempts { key } => book.forget_attempts(&key),
            Msg::DeliveryEnded { key } => book.delivery_ended(&key),
            Msg::Attempts { keys, reply } => {
                let _ = reply.send(keys.iter().map(|k| book.attempts(k)).collect());
            }
            Msg::WakeAll => book.wake_all(),
            Msg::Ack { cmd, reply } => {
                book.acks.push((cmd, reply));
                if self.acks_due.is_none() {
                    self.acks_due = Some(now + book.settings().ack_batch_wait);
                }
            }
            Msg::FastBegin {
                key,
                fingerprint,
                term,
                view,
                trace,
                reply,
            } => {
                let answer = match book.fast.begin(&key, fingerprint, term, view) {
                    Begin::Begun(txid) => {
                        if let Some(ctx) = trace {
                            book.note_trace(txid, ctx);
                        }
                        match self.mailbox.upgrade() {
                            Some(tx) => Begun::Drive(FastMark::new(Mailbox(tx), key, txid)),
                            None => {
                                book.fast_end(&key, txid, false);
                                Begun::NoTxid
                            }
                        }
                    }
                    Begin::Waiting { fingerprint, done } => Begun::Waiting { fingerprint, done },
                    Begin::NoTxid => Begun::NoTxid,
                };
                // An answer that finds no asker drops its mark: taken back.
                let _ = reply.send(answer);
            }
            Msg::FastEnd { key, txid, keep } => book.fast_end(&key, txid, keep),
            Msg::FastInFlight { txids, term, reply } => {
                let _ = reply.send(book.fast.pending(&txids, term));
            }
            Msg::FastView { txid, term, reply } => {
                let _ = reply.send(book.fast.view(txid, term));
            }
            Msg::FastHousekeeping { term, reply } => {
                let count = book.settings().txid_reserve_count;
                let _ = reply.send(book.fast.housekeeping(term, count));
            }
            Msg::FastRecorded { txids } => book.fast.recorded(&txids),
            Msg::Reserve { term, ahead, reply } => {
                let count = book.settings().txid_reserve_count;
                let answer = match book.fast.reserve(term, ahead, count) {
                    Reserve::NotNeeded => Reserving::NotNeeded,
                    Reserve::Wait(done) => Reserving::Wait(done),
                    Reserve::Go => match self.mailbox.upgrade() {
                        Some(tx) => Reserving::Go(ReserveMark::new(Mailbox(tx), term)),
                        None => {
                            book.fast.reserved(term, None);
                            Reserving::NotNeeded
                        }
                    },
                };
                let _ = reply.send(answer);
            }
            Msg::Reserved { term, range } => book.fast.reserved(term, range),
            Msg::Pick {
                undelivered,
                preparing,
                reply,
            } => {
                let _ = reply.send(book.pick(&undelivered, &preparing, now));
            }
            Msg::RedriveEnded {
                txid,
                failed,
                one_phase,
                u,
                reply,
            } => {
                let _ = reply.send(book.redrive_ended(txid, failed, one_phase, u, clock));
            }
            Msg::Prepare { addr, item, reply } => self.queue_prepare(addr, item, reply, now),
            Msg::Decision { addr, item, reply } => self.queue_decision(addr, item, reply, now),
            Msg::TakePrepares { addr, reply } => {
                let _ = reply.send(self.take_prepares(&addr, now));
            }
            Msg::TakeDecisions { addr, reply } => {
                let items =
                    book.decisions
                        .take(&addr, dtx_proto::limits::DECISION_DELIVERY_ITEMS_MAX, usize::MAX, |_| 0);
                let alone = book.decisions.single_calls(&addr, now);
                let traces = items.iter().map(|w| (w.item.txid, book.trace(w.item.txid))).collect();
                let _ = reply.send(DecisionBatch { items, alone, traces });
            }
            Msg::SenderGone { kind, addr, sender } => match kind {
                Kind::Prepares => book.prepares.abandon(&addr, sender),
                Kind::Decisions => book.decisions.abandon(&addr, sender),
            },
            Msg::SingleCalls { kind, addr } => {
                let (first, rpc, instead) = match kind {
                    Kind::Prepares => (
                        book.prepares.remember_single_calls(&addr, now),
                        "PrepareMany",
                        "one Prepare call per prepare",
                    ),
                    Kind::Decisions => (
                        book.decisions.remember_single_calls(&addr, now),
                        "ApplyDecisions",
                        "one Commit or Abort call per delivery",
                    ),
                };
                if first {
                    info!(address = %addr, "participant does not serve {rpc} (an older SDK): it gets {instead}");
                }
            }
            Msg::NoRiders { addr } => {
                if book.decisions.remember_no_riders(&addr, now) {
                    info!(
                        address = %addr,
                        "participant ignores decisions riding in PrepareMany (an older SDK): they go by ApplyDecisions"
                    );
                }
            }
        }
    }

    /// A mark for a sender task about to start.
    fn sender_mark(&self, kind: Kind, addr: &str, sender: u64) -> Option<SenderMark> {
        Some(SenderMark {
            mailbox: Mailbox(self.mailbox.upgrade()?),
            kind,
            addr: addr.to_string(),
            sender,
            armed: true,
        })
    }

    fn queue_prepare(&mut self, addr: String, item: PrepareItem, reply: oneshot::Sender<Answer<Vote>>, now: Instant) {
        if self.book.prepares.single_calls(&addr, now) {
            let _ = reply.send(Answer::SendAlone);
            return;
        }
        let Some(sender) = self.book.prepares.push(&addr, item, reply) else {
            return;
        };
        // A new sender sends at once (no wait): its first message is taken
        // here, which saves it a question.
        let first = self.take_prepares(&addr, now);
        if let Some(mark) = self.sender_mark(Kind::Prepares, &addr, sender) {
            (self.start)(Start::Prepares { addr, first, mark });
        }
    }

    fn queue_decision(
        &mut self,
        addr: String,
        item: pb::DecisionItem,
        reply: oneshot::Sender<DecisionAnswer>,
        now: Instant,
    ) {
        if self.book.decisions.single_calls(&addr, now) {
            let _ = reply.send(Answer::SendAlone);
            return;
        }
        let Some(sender) = self.book.decisions.push(&addr, item, reply) else {
            return;
        };
        if let Some(mark) = self.sender_mark(Kind::Decisions, &addr, sender) {
            (self.start)(Start::Decisions { addr, mark });
        }
    }

    fn take_prepares(&mut self, addr: &str, now: Instant) -> PrepareBatch {
        let items = self.book.prepares.take(
            addr,
            dtx_proto::limits::PREPARE_GROUP_ITEMS_MAX,
            dtx_proto::limits::PREPARE_GROUP_PAYLOAD_BYTES_MAX,
            |it: &PrepareItem| it.payload_bytes(),
        );
        let alone = self.book.prepares.single_calls(addr, now);
        let riders = if items.is_empty() || alone {
            Vec::new()
        } else {
            self.book
                .decisions
                .take_along(addr, dtx_proto::limits::DECISION_DELIVERY_ITEMS_MAX, now)
        };
        let book = &self.book;
        let traces = (items.iter().map(|w| w.item.txid()))
            .chain(riders.iter().map(|w| w.item.txid))
            .map(|t| (t, book.trace(t)))
            .collect();
        PrepareBatch {
            items,
            riders,
            alone,
            traces,
        }
    }

    /// The waiting acks go to Raft together, in a task of their own.
    fn send_acks(&mut self) {
        self.acks_due = None;
        let waiting = std::mem::take(&mut self.book.acks);
        metrics::histogram!("dtx_ack_batch_acks").record(waiting.len() as f64);
        (self.start)(Start::Acks(waiting));
    }
}

fn log_peer_event(id: &str, addr: &str, event: health::Event) {
    match event {
        health::Event::StartedFailing { error, retry_in } => {
            metrics::counter!("dtx_participant_outages_total").increment(1);
            warn!(
                participant = %Clean(id),
                address = %Clean(addr),
                "participant not answering deliveries ({}); deliveries to it now wait, one probe every {} ms at most",
                Clean(&error),
                retry_in.as_millis()
            );
        }
        health::Event::StillFailing {
            for_,
            failures,
            error,
            retry_in,
        } => warn!(
            participant = %Clean(id),
            address = %Clean(addr),
            failures,
            "participant still not answering deliveries after {} s ({}); next probe in {} ms",
            for_.as_secs(),
            Clean(&error),
            retry_in.as_millis()
        ),
        health::Event::Recovered { after, failures } => info!(
            participant = %Clean(id),
            address = %Clean(addr),
            failures,
            "participant answers deliveries again after {} ms",
            after.as_millis()
        ),
    }
}
