//! The driver's book: every piece of its leader-local state (not
//! replicated), and the rules that change it. Pure: time, the wall clock
//! and random draws come in as arguments, and nothing here waits or calls;
//! the owner task (`owner`) holds the one `Book` and applies its messages
//! to it, so no lock guards it. Where an answer waits (a parked delivery's
//! turn, a grouped message's item), the book keeps the oneshot that will
//! carry it.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::collections::HashSet;
use std::time::Duration;

use dtx_common::trace::TraceContext;
use dtx_proto::v1 as pb;
use dtx_tls::logtext::clean;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::answer::truncate_utf8;
use super::answer::DeliveryError;
use super::group::Groups;
use super::health;
use super::txids::FastBook;
use crate::ctx::ApiError;
use crate::sm::tally::Vote;
use crate::sm::Command;
use crate::sm::Outcome;
use crate::sm::Txid;

/// One queued prepare: its message and when its caller stops waiting.
#[derive(Clone)]
pub(super) struct PrepareItem {
    pub req: pb::PrepareRequest,
    /// When its caller stops waiting.
    pub deadline: Instant,
}

impl PrepareItem {
    /// A message's payload bytes count against
    /// `limits::PREPARE_GROUP_PAYLOAD_BYTES_MAX`.
    pub(super) fn payload_bytes(&self) -> usize {
        self.req.payload.len()
    }

    pub(super) fn txid(&self) -> Txid {
        self.req.txid
    }
}

/// One participant in one transaction.
pub(super) type Key = (Txid, String);

/// Where an ack's result goes.
pub(super) type AckReply = oneshot::Sender<Result<(), ApiError>>;

/// Which "task running here" set a mark is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Work {
    /// A prepare round (a client's Commit, or a re-drive): the leader loop
    /// does not start a second one.
    Driving,
    /// Phase two.
    Delivering,
}

/// What the application's Status says of a participant's last delivery
/// error: a class, never the transport's text, which would tell a refused
/// connection from a TLS failure at an address the application chose.
/// Operators see the text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// No answer: no connection, a handshake or transport failure, a
    /// timeout, or the participant failing as a whole.
    Unreachable,
    /// The participant answered and refused the message.
    Refused,
    /// Anything else (on the cluster's side, e.g. an ack not recorded yet).
    Error,
}

impl ErrorClass {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Unreachable => "unreachable",
            ErrorClass::Refused => "refused",
            ErrorClass::Error => "error",
        }
    }
}

/// What the answering leader knows of one participant's phase two in one
/// transaction (not replicated; shown by Status).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeliveryAttempts {
    pub attempts: u32,
    /// The last error in full: for operators only (ListTransactions, `admin
    /// txn show`, the console), never the application's Status.
    pub last_error: String,
    /// The last error's class: what the application's Status shows.
    pub last_error_class: Option<ErrorClass>,
    /// When the next attempt is due, ms since the Unix epoch (0: none).
    pub next_unix_ms: u64,
    /// When this leader first saw a call for it fail (one-phase commits:
    /// the clock of the give-up rule, `health::gives_up`).
    pub first_failed: Option<Instant>,
    /// This leader stopped calling the address for this transaction (it
    /// never answered; ADR 0041), ms since the Unix epoch (0: not).
    pub given_up_unix_ms: u64,
}

/// What a delivery may do next (the owner's answer to its turn).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// Call now: the call is counted in flight until reported. `probe`: the
    /// address is failing and this is its probe.
    Go { probe: bool },
    /// This delivery holds the failing address's probe turn: ask again
    /// after this long.
    Hold(Duration),
    /// It was parked, and something changed (a slot or the probe turn is
    /// free, the address answers again, a new term): look again.
    Woken,
    /// It has just stopped calling its address (the give-up rule, ADR
    /// 0041): say so, then ask again (it parks until the address answers
    /// a call).
    GaveUp,
}

/// What one delivery attempt showed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Attempt {
    /// Applied: the ack is recorded next.
    Applied,
    /// No answer, or the participant failed as a whole.
    NoAnswer(String),
    /// The participant refused this message; the next attempt in `wait`.
    Refused { message: String, wait: Duration },
}

/// What a re-drive's end changed (for its log lines).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct RedriveReport {
    /// It failed, for the n-th time in a row.
    pub failures: Option<u32>,
    /// Its one-phase commit is no longer re-sent (the give-up rule).
    pub gave_up: bool,
}

/// What `note_answered` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FirstAnswer {
    /// The address had answered before (or every address counts as
    /// answered).
    Known,
    /// Its first answer: deliveries given up on it go on.
    First,
    /// Its first answer, and the set is full now: from now on every
    /// address counts as answered.
    Full,
}

/// Participant addresses that answered a call of this node process: the
/// give-up rule spares them. Bounded: when full, every address counts as
/// answered (nothing more is given up).
#[derive(Debug, Default)]
struct Answered {
    set: HashSet<String>,
    full: bool,
}

/// How many answering addresses a node remembers (a deployment has far
/// fewer participants; `participants.allowed_addresses` bounds them).
pub(super) const ANSWERED_ADDRESSES_MAX: usize = 65_536;

/// How many transactions' trace contexts a leader keeps (those of
/// transactions with no work here are dropped first).
pub(super) const TRACES_MAX: usize = 65_536;

#[derive(Clone, Copy, Debug)]
struct Backoff {
    failures: u32,
    not_before: Instant,
}

/// The txid each background scan took last.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cursors {
    pub undelivered: Txid,
    pub preparing: Txid,
}

/// One running delivery (one participant of one transaction), as the
/// owner sees it.
#[derive(Debug)]
struct Delivery {
    addr: String,
    retried: health::Retried,
    /// When it first asked for a turn (the give-up rule's clock).
    started: Instant,
    /// It holds its address's probe turn.
    holder: bool,
    /// Its call is out (`Some(probe)`) and not reported yet.
    in_flight: Option<bool>,
    /// It stopped calling (the give-up rule).
    given_up: bool,
    /// It waits for a wake-up: its place in its address's line, and its
    /// answer.
    parked: Option<(u64, oneshot::Sender<Step>)>,
}

/// The deliveries parked on one address, in the order they parked.
#[derive(Debug, Default)]
struct Parked {
    /// Waiting for a slot or the probe turn.
    turns: BTreeMap<u64, Key>,
    /// Given up: waiting for the address to answer any call.
    given_up: BTreeMap<u64, Key>,
}

/// The settings the book's rules use.
#[derive(Clone, Copy, Debug)]
pub(super) struct Settings {
    pub retry_base: Duration,
    pub retry_max: Duration,
    /// Calls in flight to one address at most.
    pub inflight_max: u32,
    /// How often a failing address is reported again.
    pub warn_every: Duration,
    /// `txn.never_answered_give_up_ms` (zero: never).
    pub give_up_after: Duration,
    /// `txn.ack_batch_wait_ms`.
    pub ack_batch_wait: Duration,
    /// `txn.txid_reserve_count`.
    pub txid_reserve_count: u64,
}

/// Everything the driver keeps on this node.
pub(super) struct Book {
    settings: Settings,
    /// Per address: the prepares waiting for the next PrepareMany.
    pub prepares: Groups<PrepareItem, Vote>,
    /// Per address: the decisions waiting for the next ApplyDecisions.
    pub decisions: Groups<pb::DecisionItem, Result<(), DeliveryError>>,
    /// The one-write path's txid ranges, in-flight txids and keys.
    pub fast: FastBook,
    /// Acks waiting to go through Raft together.
    pub acks: Vec<(Command, AckReply)>,
    driving: HashSet<Txid>,
    delivering: HashSet<Txid>,
    /// The decision seen for a transaction with work here: it never
    /// changes (decisions are written once).
    seen: HashMap<Txid, Outcome>,
    /// Every participant address deliveries go to, and how it is doing.
    peers: health::Peers,
    deliveries: HashMap<Key, Delivery>,
    parked: HashMap<String, Parked>,
    next_park: u64,
    /// Per participant of a transaction: the delivery attempts so far (for
    /// Status), and a one-phase commit's failed calls.
    attempts: HashMap<Key, DeliveryAttempts>,
    /// PREPARING transactions whose re-drive ended without a decision: not
    /// re-driven again before their backoff has passed.
    redrive_backoff: HashMap<Txid, Backoff>,
    /// Where the leader loop's scans go on from (invariant 11).
    cursors: Cursors,
    /// Per transaction driven here: the trace context of the request that
    /// drove it, carried on its calls to participants.
    traces: HashMap<Txid, TraceContext>,
    answered: Answered,
    /// One-phase commits no longer re-sent: their participant's address
    /// never answered within the bound (per txid, the address and the
    /// participant id). Re-driven again once the address answers anything.
    one_phase_given_up: HashMap<Txid, (String, String)>,
}

impl Book {
    pub fn new(settings: Settings) -> Book {
        Book {
            settings,
            prepares: Groups::default(),
            decisions: Groups::default(),
            fast: FastBook::default(),
            acks: Vec::new(),
            driving: HashSet::new(),
            delivering: HashSet::new(),
            seen: HashMap::new(),
            peers: health::Peers::new(
                settings.retry_base,
                settings.retry_max,
                settings.warn_every,
                settings.inflight_max,
            ),
            deliveries: HashMap::new(),
            parked: HashMap::new(),
            next_park: 0,
            attempts: HashMap::new(),
            redrive_backoff: HashMap::new(),
            cursors: Cursors::default(),
            traces: HashMap::new(),
            answered: Answered::default(),
            one_phase_given_up: HashMap::new(),
        }
    }

    // --- marks: which transactions have a task here -------------------

    fn set(&mut self, work: Work) -> &mut HashSet<Txid> {
        match work {
            Work::Driving => &mut self.driving,
            Work::Delivering => &mut self.delivering,
        }
    }

    /// Marks `txid` as having a task of `work` here; false if one has it.
    pub fn mark(&mut self, work: Work, txid: Txid) -> bool {
        self.set(work).insert(txid)
    }

    /// The task of `work` on `txid` ended. Phase two's end also forgets
    /// the transaction's trace context.
    pub fn unmark(&mut self, work: Work, txid: Txid) {
        debug_assert!(self.set(work).contains(&txid), "{work:?} mark of {txid} dropped twice");
        self.set(work).remove(&txid);
        if work == Work::Delivering {
            self.traces.remove(&txid);
        }
        if !self.busy(txid) {
            self.seen.remove(&txid);
        }
    }

    /// Some work on `txid` runs here.
    fn busy(&self, txid: Txid) -> bool {
        self.driving.contains(&txid) || self.delivering.contains(&txid) || self.fast.in_flight_here(txid)
    }

    /// A fast-path call ended (`owner::FastMark`): see `FastBook::end`.
    pub fn fast_end(&mut self, key: &str, txid: Txid, keep: bool) {
        self.fast.end(key, txid, keep);
        if !self.busy(txid) {
            self.seen.remove(&txid);
        }
    }

    /// The settings the book was made with.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The work on `txid` saw its recorded decision `outcome`. Decisions
    /// are written once: while any work on `txid` runs here, every outcome
    /// seen for it is the same.
    pub fn saw_decision(&mut self, txid: Txid, outcome: Outcome) {
        if let Some(before) = self.seen.get(&txid) {
            debug_assert_eq!(
                *before, outcome,
                "the recorded decision of {txid} changed: {before} seen before, now {outcome}"
            );
            return;
        }
        if self.busy(txid) {
            self.seen.insert(txid, outcome);
        }
    }

    // --- trace contexts -------------------------------------------------

    /// Keeps `ctx` as the trace of `txid`'s participant calls. When full,
    /// the traces of transactions with no work here go first.
    pub fn note_trace(&mut self, txid: Txid, ctx: TraceContext) {
        if self.traces.len() >= TRACES_MAX && !self.traces.contains_key(&txid) {
            let mut traces = std::mem::take(&mut self.traces);
            traces.retain(|t, _| self.busy(*t));
            if traces.len() >= TRACES_MAX {
                traces.clear();
            }
            self.traces = traces;
        }
        self.traces.insert(txid, ctx);
    }

    pub fn trace(&self, txid: Txid) -> Option<TraceContext> {
        self.traces.get(&txid).cloned()
    }

    // --- addresses that answered -----------------------------------------

    /// `addr` answered a call (any answer of the participant protocol,
    /// refusals included): it is never given up from now on, and
    /// deliveries given up on it go on.
    pub fn note_answered(&mut self, addr: &str) -> FirstAnswer {
        let a = &mut self.answered;
        let first = if a.full || a.set.contains(addr) {
            FirstAnswer::Known
        } else if a.set.len() >= ANSWERED_ADDRESSES_MAX {
            a.full = true;
            FirstAnswer::Full
        } else {
            a.set.insert(addr.to_string());
            FirstAnswer::First
        };
        if first != FirstAnswer::Known {
            self.wake(addr, health::Wake::All);
        }
        first
    }

    /// `addr` answered a call from this process once, at least.
    fn answered_once(&self, addr: &str) -> bool {
        self.answered.full || self.answered.set.contains(addr)
    }

    // --- deliveries ---------------------------------------------------------

    /// The delivery `key` to `addr` asks for its next step at `now`; the
    /// answer goes to `reply`, now or, parked, when something changes.
    pub fn next_turn(
        &mut self,
        key: Key,
        addr: &str,
        retried: health::Retried,
        (now, now_ms): (Instant, u64),
        reply: oneshot::Sender<Step>,
    ) {
        let answered_once = self.answered_once(addr);
        let d = self.deliveries.entry(key.clone()).or_insert_with(|| Delivery {
            addr: addr.to_string(),
            retried,
            started: now,
            holder: false,
            in_flight: None,
            given_up: false,
            parked: None,
        });
        debug_assert_eq!(d.addr, addr, "a delivery keeps its address");
        let was_parked = d.parked.take();
        if let Some(probe) = d.in_flight {
            // Its last answer was lost (its wait ended first): the slot is
            // still its own.
            let _ = reply.send(Step::Go { probe });
            return;
        }
        let gives_up = health::gives_up(
            d.retried,
            answered_once,
            now.saturating_duration_since(d.started),
            self.settings.give_up_after,
        );
        if gives_up {
            if d.given_up {
                if let Some((seq, _)) = was_parked {
                    self.unpark(addr, seq);
                }
                self.park(key, reply, true);
                return;
            }
            d.given_up = true;
            let released = std::mem::take(&mut d.holder);
            let retried = d.retried;
            if let Some((seq, _)) = was_parked {
                self.unpark(addr, seq);
            }
            self.give_up(&key, addr, retried, now_ms);
            if released {
                // The probe turn passes on (to a delivery that still tries).
                let wake = self.peers.release(addr);
                self.wake(addr, wake);
            }
            let _ = reply.send(Step::GaveUp);
            return;
        }
        if std::mem::take(&mut d.given_up) {
            // The address answered meanwhile: deliver again.
            if let Some(a) = self.attempts.get_mut(&key) {
                a.given_up_unix_ms = 0;
            }
        }
        let holder = d.holder;
        if let Some((seq, _)) = was_parked {
            self.unpark(addr, seq);
        }
        let turn = self.peers.turn(addr, now, holder);
        let d = self.deliveries.get_mut(&key).expect("inserted above");
        match turn {
            health::Turn::Go { probe } => {
                d.holder = probe;
                d.in_flight = Some(probe);
                let _ = reply.send(Step::Go { probe });
            }
            health::Turn::Hold(wait) => {
                // This delivery probes the failing address next.
                d.holder = true;
                self.note_attempt(key, None, Some(wait), (now, now_ms));
                let _ = reply.send(Step::Hold(wait));
            }
            health::Turn::Park => {
                // Another delivery probes it, or the in-flight limit is
                // reached: wait to be woken, at no cost.
                d.holder = false;
                self.note_attempt(key.clone(), None, None, (now, now_ms));
                self.park(key, reply, false);
            }
        }
    }

    fn park(&mut self, key: Key, reply: oneshot::Sender<Step>, given_up: bool) {
        let Some(d) = self.deliveries.get_mut(&key) else { return };
        let seq = self.next_park;
        self.next_park += 1;
        d.parked = Some((seq, reply));
        let line = self.parked.entry(d.addr.clone()).or_default();
        if given_up {
            line.given_up.insert(seq, key);
        } else {
            line.turns.insert(seq, key);
        }
    }

    fn unpark(&mut self, addr: &str, seq: u64) {
        if let Some(line) = self.parked.get_mut(addr) {
            line.turns.remove(&seq);
            line.given_up.remove(&seq);
            if line.turns.is_empty() && line.given_up.is_empty() {
                self.parked.remove(addr);
            }
        }
    }

    /// Wakes the deliveries parked on `addr` that `wake` names: one
    /// waiting for a turn (the oldest still waiting), or every one.
    pub fn wake(&mut self, addr: &str, wake: health::Wake) {
        let Some(line) = self.parked.get_mut(addr) else { return };
        let woken: Vec<Key> = match wake {
            health::Wake::Nobody => return,
            health::Wake::One => {
                let mut woken = Vec::new();
                while let Some((_, key)) = line.turns.pop_first() {
                    let live = self
                        .deliveries
                        .get(&key)
                        .and_then(|d| d.parked.as_ref())
                        .is_some_and(|(_, r)| !r.is_closed());
                    woken.push(key);
                    if live {
                        break;
                    }
                }
                woken
            }
            health::Wake::All => {
                let turns = std::mem::take(&mut line.turns);
                let given_up = std::mem::take(&mut line.given_up);
                turns.into_values().chain(given_up.into_values()).collect()
            }
        };
        if line.turns.is_empty() && line.given_up.is_empty() {
            self.parked.remove(addr);
        }
        for key in woken {
            if let Some((_, reply)) = self.deliveries.get_mut(&key).and_then(|d| d.parked.take()) {
                let _ = reply.send(Step::Woken);
            }
        }
    }

    /// Wakes every parked delivery (a new term: each looks at its
    /// leadership again).
    pub fn wake_all(&mut self) {
        let addrs: Vec<String> = self.parked.keys().cloned().collect();
        for addr in addrs {
            self.wake(&addr, health::Wake::All);
        }
    }

    /// The delivery `key` reports its call (given `Go`): what it showed
    /// about the address (for its health record) and for Status. Returns
    /// the address's event to log, if any.
    pub fn report(
        &mut self,
        key: Key,
        attempt: Attempt,
        u: f64,
        (now, now_ms): (Instant, u64),
    ) -> Option<(String, health::Event)> {
        let d = self.deliveries.get_mut(&key)?;
        let probe = d.in_flight.take()?;
        let addr = d.addr.clone();
        let seen = match &attempt {
            Attempt::NoAnswer(e) => health::Seen::Failed(e.clone()),
            Attempt::Applied | Attempt::Refused { .. } => {
                // It answered: the probe turn, if it held it, is over.
                d.holder = false;
                health::Seen::Answered
            }
        };
        if seen == health::Seen::Answered {
            self.note_answered(&addr);
        }
        let (event, wake) = self.peers.report(&addr, probe, seen, now, u);
        self.wake(&addr, wake);
        match attempt {
            Attempt::Applied => {}
            Attempt::NoAnswer(e) => self.note_attempt(key, Some((ErrorClass::Unreachable, e)), None, (now, now_ms)),
            Attempt::Refused { message, wait } => {
                self.note_attempt(key, Some((ErrorClass::Refused, message)), Some(wait), (now, now_ms))
            }
        }
        event.map(|e| (addr, e))
    }

    /// The delivery `key` ended, however it ended: its attempts stop being
    /// shown, a call it had out frees its slot, and a probe turn it held
    /// passes on.
    pub fn delivery_ended(&mut self, key: &Key) {
        self.attempts.remove(key);
        let Some(d) = self.deliveries.remove(key) else { return };
        if let Some((seq, _)) = d.parked {
            self.unpark(&d.addr, seq);
        }
        if let Some(probe) = d.in_flight {
            let wake = self.peers.abandon(&d.addr, probe);
            self.wake(&d.addr, wake);
        }
        if d.holder {
            let wake = self.peers.release(&d.addr);
            self.wake(&d.addr, wake);
        }
    }

    /// How many addresses are failing now.
    pub fn failing(&self) -> usize {
        self.peers.failing()
    }

    // --- attempts (Status) ------------------------------------------------

    /// Notes an attempt of `key`: a failed one with `error`, and when the
    /// next is due.
    pub fn note_attempt(
        &mut self,
        key: Key,
        error: Option<(ErrorClass, String)>,
        next_in: Option<Duration>,
        (now, now_ms): (Instant, u64),
    ) {
        let a = self.attempts.entry(key).or_default();
        if let Some((class, e)) = error {
            a.attempts = a.attempts.saturating_add(1);
            a.last_error = e;
            a.last_error_class = Some(class);
            a.first_failed.get_or_insert(now);
        }
        a.next_unix_ms = next_in
            .map(|d| now_ms.saturating_add(d.as_millis() as u64))
            .unwrap_or(0);
    }

    /// The attempts of `key` stop being shown (the work ended).
    pub fn forget_attempts(&mut self, key: &Key) {
        self.attempts.remove(key);
    }

    pub fn attempts(&self, key: &Key) -> Option<DeliveryAttempts> {
        self.attempts.get(key).cloned()
    }

    /// Marks `key`'s calls to `addr` as given up: shown to operators with
    /// the last error.
    fn give_up(&mut self, key: &Key, addr: &str, what: health::Retried, now_ms: u64) {
        let bound_ms = self.settings.give_up_after.as_millis();
        let a = self.attempts.entry(key.clone()).or_default();
        a.given_up_unix_ms = now_ms;
        a.next_unix_ms = 0;
        a.last_error = format!(
            "stopped {}: address {} never answered this leader within txn.never_answered_give_up_ms \
             ({bound_ms} ms), so it is not called again for this transaction unless it answers a call; \
             drop the participant or resolve the transaction. Last error: {}",
            doing(what),
            clean(addr),
            a.last_error
        );
        truncate_utf8(&mut a.last_error, crate::limits::REASON_BYTES_MAX);
    }

    // --- the leader loop's background work ----------------------------------

    /// The leader loop's work for one round, from every decided, unacked
    /// transaction (`undelivered`) and every PREPARING one (`preparing`),
    /// both ascending: those with no task here (and no re-drive backing
    /// off, no one-phase commit given up), so even a new leader's first
    /// round reaches every transaction, whatever number is stuck. A stuck
    /// transaction keeps its task (parked, at no cost) and is then skipped,
    /// so stuck ones never starve the others (invariant 11). Each scan
    /// starts after the last txid it took and wraps around, so the order
    /// tasks start in rotates between rounds.
    pub fn pick(&mut self, undelivered: &[Txid], preparing: &[Txid], now: Instant) -> (Vec<Txid>, Vec<Txid>) {
        let undelivered: Vec<Txid> = wrapped_after(undelivered, self.cursors.undelivered)
            .filter(|t| !self.delivering.contains(t))
            .collect();
        // Forget what is kept of transactions no longer PREPARING.
        let still_preparing = |t: &Txid| preparing.binary_search(t).is_ok();
        if self.redrive_backoff.len() > preparing.len() {
            self.redrive_backoff.retain(|t, _| still_preparing(t));
        }
        if self.one_phase_given_up.len() > preparing.len() {
            self.one_phase_given_up.retain(|t, _| still_preparing(t));
        }
        let mut picked = Vec::new();
        for t in wrapped_after(preparing, self.cursors.preparing) {
            if !self.driving.contains(&t)
                && self.redrive_backoff.get(&t).is_none_or(|b| b.not_before <= now)
                && !self.one_phase_given_up(t)
            {
                picked.push(t);
            }
        }
        if let Some(&t) = undelivered.last() {
            self.cursors.undelivered = t;
        }
        if let Some(&t) = picked.last() {
            self.cursors.preparing = t;
        }
        (undelivered, picked)
    }

    /// The one-phase commit `txid` is not re-driven: given up on an
    /// address that has not answered since.
    fn one_phase_given_up(&mut self, txid: Txid) -> bool {
        let Some((addr, pid)) = self.one_phase_given_up.get(&txid) else {
            return false;
        };
        if !self.answered_once(addr) {
            return true;
        }
        if let Some(a) = self.attempts.get_mut(&(txid, pid.clone())) {
            a.given_up_unix_ms = 0;
        }
        self.one_phase_given_up.remove(&txid);
        false
    }

    /// A re-drive of `txid` ended (`failed`: without a decision). A failed
    /// one-phase commit (to `one_phase`: its address and participant id)
    /// stops being re-sent when the give-up rule says so; a failed
    /// re-drive backs off (`u`: the jitter's uniform draw).
    pub fn redrive_ended(
        &mut self,
        txid: Txid,
        failed: bool,
        one_phase: Option<(String, String)>,
        u: f64,
        (now, now_ms): (Instant, u64),
    ) -> RedriveReport {
        let mut report = RedriveReport::default();
        if !failed {
            self.redrive_backoff.remove(&txid);
            return report;
        }
        if let Some((addr, pid)) = one_phase {
            let key = (txid, pid);
            let trying_for = self
                .attempts
                .get(&key)
                .and_then(|a| a.first_failed)
                .map(|t| now.saturating_duration_since(t))
                .unwrap_or_default();
            let what = health::Retried::OnePhaseCommit;
            if health::gives_up(what, self.answered_once(&addr), trying_for, self.settings.give_up_after)
                && self
                    .one_phase_given_up
                    .insert(txid, (addr.clone(), key.1.clone()))
                    .is_none()
            {
                self.give_up(&key, &addr, what, now_ms);
                report.gave_up = true;
            }
        }
        let failures = self
            .redrive_backoff
            .get(&txid)
            .map(|b| b.failures)
            .unwrap_or(0)
            .saturating_add(1);
        let wait = health::backoff(
            self.settings.retry_base,
            self.settings.retry_max,
            failures.saturating_add(1),
            u,
        );
        self.redrive_backoff.insert(
            txid,
            Backoff {
                failures,
                not_before: now + wait,
            },
        );
        report.failures = Some(failures);
        report
    }
}

/// What a delivery given up on was doing, for its note and log line.
pub(super) fn doing(what: health::Retried) -> &'static str {
    match what {
        health::Retried::OnePhaseCommit => "re-sending the one-phase commit",
        _ => "delivering the ABORT",
    }
}

/// The members of the ascending `txids` above `cursor`, then those up to
/// and including it.
fn wrapped_after(txids: &[Txid], cursor: Txid) -> impl Iterator<Item = Txid> + '_ {
    let at = txids.partition_point(|t| *t <= cursor);
    txids[at..].iter().chain(&txids[..at]).copied()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::sync::oneshot::error::TryRecvError;

    use super::*;
    use crate::driver::txids::Begin;
    use crate::driver::txids::InFlightView;
    use crate::driver::txids::Reserve;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn book(inflight_max: u32) -> Book {
        Book::new(Settings {
            retry_base: ms(50),
            retry_max: ms(2_000),
            inflight_max,
            warn_every: Duration::from_secs(30),
            give_up_after: ms(1_000),
            ack_batch_wait: ms(2),
            txid_reserve_count: 8,
        })
    }

    fn key(txid: Txid) -> Key {
        (txid, "p".to_string())
    }

    /// Asks for `txid`'s turn at `addr`: its answer's receiver.
    fn ask(b: &mut Book, txid: Txid, addr: &str, what: health::Retried, now: Instant) -> oneshot::Receiver<Step> {
        let (tx, rx) = oneshot::channel();
        b.next_turn(key(txid), addr, what, (now, 1_000), tx);
        rx
    }

    fn answer(rx: &mut oneshot::Receiver<Step>) -> Option<Step> {
        match rx.try_recv() {
            Ok(s) => Some(s),
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Closed) => panic!("the answer was dropped"),
        }
    }

    const COMMIT: health::Retried = health::Retried::CommitDelivery;
    const ABORT: health::Retried = health::Retried::AbortDelivery;

    #[test]
    fn a_mark_is_held_once_and_phase_twos_end_forgets_the_trace() {
        let mut b = book(4);
        assert!(b.mark(Work::Delivering, 7));
        assert!(!b.mark(Work::Delivering, 7), "one task per txid");
        assert!(b.mark(Work::Driving, 7), "the other kind is apart");
        b.note_trace(7, TraceContext::new_root());
        b.unmark(Work::Driving, 7);
        assert!(b.trace(7).is_some());
        b.unmark(Work::Delivering, 7);
        assert!(b.trace(7).is_none());
        assert!(b.mark(Work::Delivering, 7), "free again");
    }

    #[test]
    fn a_decision_seen_while_work_runs_is_remembered_until_the_work_ends() {
        let mut b = book(4);
        b.saw_decision(1, Outcome::Commit);
        assert!(b.seen.is_empty(), "no work on 1 here: nothing kept");
        b.mark(Work::Driving, 1);
        b.saw_decision(1, Outcome::Commit);
        b.mark(Work::Delivering, 1);
        b.unmark(Work::Driving, 1);
        b.saw_decision(1, Outcome::Commit);
        assert_eq!(b.seen.get(&1), Some(&Outcome::Commit));
        b.unmark(Work::Delivering, 1);
        assert!(b.seen.is_empty());
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "the recorded decision of 1 changed")]
    fn a_decision_that_changes_is_caught() {
        let mut b = book(4);
        b.mark(Work::Delivering, 1);
        b.saw_decision(1, Outcome::Abort);
        b.saw_decision(1, Outcome::Commit);
    }

    /// Invariant 11: a slot freed at an address goes to the oldest parked
    /// delivery, as a wake-up (it then asks again).
    #[test]
    fn deliveries_over_the_in_flight_limit_park_and_a_freed_slot_wakes_one() {
        let mut b = book(1);
        let now = Instant::now();
        assert_eq!(b.note_answered("a"), FirstAnswer::First);
        assert_eq!(
            answer(&mut ask(&mut b, 1, "a", COMMIT, now)),
            Some(Step::Go { probe: false })
        );
        let mut second = ask(&mut b, 2, "a", COMMIT, now);
        let mut third = ask(&mut b, 3, "a", COMMIT, now);
        assert_eq!(answer(&mut second), None, "parked");
        assert_eq!(answer(&mut third), None, "parked");
        assert_eq!(b.attempts(&key(2)).map(|a| a.next_unix_ms), Some(0), "shown as waiting");
        assert_eq!(b.report(key(1), Attempt::Applied, 1.0, (now, 1_000)), None);
        assert_eq!(answer(&mut second), Some(Step::Woken), "the oldest first");
        assert_eq!(answer(&mut third), None);
        assert_eq!(
            answer(&mut ask(&mut b, 2, "a", COMMIT, now)),
            Some(Step::Go { probe: false })
        );
        // A new term wakes everyone.
        b.wake_all();
        assert_eq!(answer(&mut third), Some(Step::Woken));
    }

    /// A failing address has one probe turn; the holder that ends passes
    /// it on, and a call that never reported gives its slot back.
    #[test]
    fn the_probe_turn_and_a_slot_come_back_when_their_delivery_ends() {
        let mut b = book(4);
        let t0 = Instant::now();
        assert_eq!(
            answer(&mut ask(&mut b, 1, "a", COMMIT, t0)),
            Some(Step::Go { probe: false })
        );
        let event = b.report(key(1), Attempt::NoAnswer("refused".into()), 1.0, (t0, 1_000));
        assert!(matches!(event, Some((a, health::Event::StartedFailing { .. })) if a == "a"));
        assert_eq!(b.attempts(&key(1)).map(|a| a.attempts), Some(1));
        assert_eq!(b.failing(), 1);
        assert_eq!(answer(&mut ask(&mut b, 1, "a", COMMIT, t0)), Some(Step::Hold(ms(50))));
        let mut other = ask(&mut b, 2, "a", COMMIT, t0);
        assert_eq!(answer(&mut other), None, "parked behind the probe");
        b.delivery_ended(&key(1));
        assert!(b.attempts(&key(1)).is_none(), "its attempts go with it");
        assert_eq!(answer(&mut other), Some(Step::Woken), "the turn passed on");
        let t1 = t0 + ms(60);
        assert_eq!(
            answer(&mut ask(&mut b, 2, "a", COMMIT, t1)),
            Some(Step::Go { probe: true })
        );
        // Cancelled mid-call: its slot and the turn come back.
        let mut third = ask(&mut b, 3, "a", COMMIT, t1);
        assert_eq!(answer(&mut third), None);
        b.delivery_ended(&key(2));
        assert_eq!(answer(&mut third), Some(Step::Woken));
        assert_eq!(
            answer(&mut ask(&mut b, 3, "a", COMMIT, t1)),
            Some(Step::Go { probe: true })
        );
    }

    /// ADR 0041: an ABORT to an address that never answered is given up
    /// after the bound (a COMMIT never is); it waits, apart, until the
    /// address answers any call.
    #[test]
    fn an_abort_to_a_never_answering_address_is_given_up_until_it_answers() {
        let mut b = book(4);
        let t0 = Instant::now();
        assert_eq!(
            answer(&mut ask(&mut b, 1, "a", ABORT, t0)),
            Some(Step::Go { probe: false })
        );
        assert_eq!(
            answer(&mut ask(&mut b, 2, "a", COMMIT, t0)),
            Some(Step::Go { probe: false })
        );
        b.report(key(1), Attempt::NoAnswer("refused".into()), 1.0, (t0, 1_000));
        let later = t0 + ms(1_000);
        assert_eq!(answer(&mut ask(&mut b, 1, "a", ABORT, later)), Some(Step::GaveUp));
        let a = b.attempts(&key(1)).expect("shown");
        assert_eq!(a.given_up_unix_ms, 1_000);
        assert!(
            a.last_error.starts_with("stopped delivering the ABORT"),
            "{}",
            a.last_error
        );
        let mut given_up = ask(&mut b, 1, "a", ABORT, later);
        assert_eq!(answer(&mut given_up), None, "parked apart");
        let mut holder = ask(&mut b, 4, "a", COMMIT, later);
        assert_eq!(answer(&mut holder), Some(Step::Go { probe: true }));
        let mut waiting = ask(&mut b, 3, "a", COMMIT, later);
        assert_eq!(answer(&mut waiting), None, "behind the probe turn");
        b.wake("a", health::Wake::One);
        assert_eq!(
            answer(&mut waiting),
            Some(Step::Woken),
            "a wake-up goes to one that tries"
        );
        assert_eq!(answer(&mut given_up), None);
        // The COMMIT's call is answered: the address answered once.
        b.report(key(2), Attempt::Applied, 1.0, (later, 2_000));
        assert_eq!(answer(&mut given_up), Some(Step::Woken));
        assert_eq!(
            answer(&mut ask(&mut b, 1, "a", ABORT, later)),
            Some(Step::Go { probe: false })
        );
        assert_eq!(b.attempts(&key(1)).map(|a| a.given_up_unix_ms), Some(0));
    }

    /// Invariant 11: each scan starts after the txid it took last, wraps
    /// around, and skips transactions with a task here or backing off.
    #[test]
    fn the_leader_loop_rotates_and_skips_work_running_or_backing_off() {
        let mut b = book(4);
        let now = Instant::now();
        b.mark(Work::Delivering, 2);
        b.mark(Work::Driving, 11);
        let (u, p) = b.pick(&[1, 2, 3], &[10, 11, 12], now);
        assert_eq!((u, p), (vec![1, 3], vec![10, 12]));
        assert_eq!(
            b.cursors,
            Cursors {
                undelivered: 3,
                preparing: 12
            }
        );
        let (u, _) = b.pick(&[1, 2, 3, 4, 5], &[], now);
        assert_eq!(u, vec![4, 5, 1, 3], "after 3, then around (2 has its task)");
        // A failed re-drive backs off; a finished one does not.
        b.unmark(Work::Driving, 11);
        let r = b.redrive_ended(10, true, None, 1.0, (now, 1_000));
        assert_eq!(r.failures, Some(1));
        assert_eq!(b.redrive_ended(10, true, None, 1.0, (now, 1_000)).failures, Some(2));
        b.redrive_ended(12, false, None, 1.0, (now, 1_000));
        let (_, p) = b.pick(&[], &[10, 11, 12], now);
        assert_eq!(p, vec![11, 12], "10 backs off");
        let (_, p) = b.pick(&[], &[10, 11, 12], now + ms(2_000));
        assert!(p.contains(&10), "its backoff passed");
        // No longer PREPARING: its backoff is forgotten.
        b.pick(&[], &[], now);
        assert!(b.redrive_backoff.is_empty());
    }

    /// ADR 0041: a one-phase commit whose address never answered stops
    /// being re-driven after the bound, until the address answers.
    #[test]
    fn a_one_phase_commit_is_given_up_until_its_address_answers() {
        let mut b = book(4);
        let t0 = Instant::now();
        let k = key(5);
        b.note_attempt(
            k.clone(),
            Some((ErrorClass::Unreachable, "refused".into())),
            None,
            (t0, 1_000),
        );
        let one_phase = || Some(("a".to_string(), "p".to_string()));
        let r = b.redrive_ended(5, true, one_phase(), 1.0, (t0 + ms(10), 1_010));
        assert!(!r.gave_up, "before the bound");
        let r = b.redrive_ended(5, true, one_phase(), 1.0, (t0 + ms(1_000), 2_000));
        assert!(r.gave_up);
        assert!(
            !b.redrive_ended(5, true, one_phase(), 1.0, (t0 + ms(2_000), 3_000))
                .gave_up,
            "said once"
        );
        let later = t0 + ms(60_000);
        assert_eq!(b.pick(&[], &[5], later).1, Vec::<Txid>::new(), "not re-driven");
        assert_eq!(b.note_answered("a"), FirstAnswer::First);
        assert_eq!(b.note_answered("a"), FirstAnswer::Known);
        assert_eq!(b.pick(&[], &[5], later).1, vec![5], "re-driven again");
        assert_eq!(b.attempts(&k).map(|a| a.given_up_unix_ms), Some(0));
    }

    fn view() -> Arc<InFlightView> {
        Arc::new(InFlightView {
            participants: Vec::new(),
            begun_ms: 0,
            deadline_ms: 0,
            owner: None,
        })
    }

    /// ADR 0012: txids come from this term's range, one reservation at a
    /// time; a txid is PENDING while its write may apply; a key in flight
    /// makes a retry wait.
    #[tokio::test]
    async fn the_fast_path_hands_out_each_txid_once_and_answers_pending_while_in_flight() {
        let mut b = book(4);
        assert!(matches!(b.fast.begin("k1", [1; 32], 3, view()), Begin::NoTxid));
        assert!(matches!(b.fast.reserve(3, false, 8), Reserve::Go));
        let Reserve::Wait(waiting) = b.fast.reserve(3, false, 8) else {
            panic!("one reservation at a time")
        };
        b.fast.reserved(3, Some((100, 104)));
        waiting.await.expect("the waiter goes on");
        assert!(matches!(b.fast.reserve(3, false, 8), Reserve::NotNeeded));
        let Begin::Begun(t) = b.fast.begin("k1", [1; 32], 3, view()) else {
            panic!("a txid")
        };
        assert_eq!(t, 100);
        assert!(b.busy(100));
        let Begin::Waiting { fingerprint, mut done } = b.fast.begin("k1", [2; 32], 3, view()) else {
            panic!("the key is in flight")
        };
        assert_eq!(fingerprint, [1; 32]);
        assert_eq!(b.fast.pending(&[100, 101, 102], 3), vec![true, false, false]);
        assert_eq!(b.fast.pending(&[100], 4), vec![false], "another term's read");
        let Begin::Begun(t) = b.fast.begin("k2", [1; 32], 3, view()) else {
            panic!("a txid")
        };
        assert_eq!(t, 103, "101 and 102 were answered unknown: skipped for good");
        assert!(b.fast.view(103, 3).is_some());
        // Ran low: a spare is reserved ahead.
        assert!(b.fast.housekeeping(3, 8).1);
        b.fast_end("k1", 100, true);
        done.changed().await.expect_err("the waiter goes on");
        assert_eq!(b.fast.pending(&[100], 3), vec![true], "kept: its write may apply");
        b.fast_end("k2", 103, false);
        assert_eq!(b.fast.pending(&[103], 3), vec![false]);
        let (in_flight, _) = b.fast.housekeeping(3, 8);
        assert_eq!(in_flight, vec![100]);
        b.fast.recorded(&in_flight);
        assert!(!b.busy(100));
        // A new term drops the old range.
        assert!(matches!(b.fast.begin("k3", [1; 32], 4, view()), Begin::NoTxid));
    }
}
