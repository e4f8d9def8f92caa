//! Checkers: find anomalies in a recorded history (see [`crate::history`]).
//!
//! [`check`] reads the whole history once, indexes it, and runs one pass per
//! family of anomalies. Every anomaly names the transaction (when it has one)
//! and says in words what was seen. The verdict ([`Validity`]) is
//!
//! - `invalid` when any anomaly was found (even if the check could not finish),
//! - else `unknown` when the time limit ran out or an observation the checks
//!   need is missing (no apply log at all, no apply log for a service the
//!   history touches, no bank setup, no final balances for a service of the
//!   bank); [`Report::unknown_reason`] says which,
//! - else `valid`.
//!
//! A transfer the client saw end in `info` (UNKNOWN), or that never completed,
//! may or may not have happened: it never produces an anomaly by itself,
//! whether its participants committed it or aborted it. Only what the
//! participants and coordinator nodes did with it can (a split between its
//! participants is still a split).
//!
//! # Anomaly kinds and the invariants of docs/design.md they guard
//!
//! | kind | what it means | invariant |
//! |---|---|---|
//! | `split-outcome` | the apply logs show COMMIT for the txid at one service and ABORT at another | 3 (atomicity) |
//! | `applied-against-decision` | every decided read of the txid agrees on one decision, and a participant applied the other outcome | 3, 5 (a participant applies the recorded decision and nothing else) |
//! | `decision-changed` | reads of the txid from one node, in history order, show a decided outcome and later the other one, or a decided outcome and later PENDING (decided then UNKNOWN is allowed: forgotten after all acks, invariant 10) | 1 (write-once decision) |
//! | `decision-differs-between-nodes` | one node answered COMMIT and another node ABORT for the txid | 1, 7 (linearizable reads) |
//! | `acked-commit-lost` | a client was told COMMITTED, but a decision read shows ABORT, or a participant of the transfer (`from.service`, `to.service`) whose apply log is in the history has no COMMIT for it, or applied ABORT | 4 (durability) |
//! | `acked-abort-but-applied` | a client was told ABORTED (a `fail` with a txid), but an apply log has COMMIT for it, a decision read says COMMIT, or another client was told COMMITTED for the same txid | 1, 3 |
//! | `duplicate-apply` | a txid appears more than once in one service's apply log | 8 (exactly-once effect) |
//! | `applied-never-begun` | an apply log has a COMMIT for a txid that no transfer (any kind) and no decision read mentions (an ABORT of one is the presumed abort of a one-write commit whose leader died before its write, ADR 0012) | 5 (only a recorded decision resolves a participant), 10 (txids are not reused) |
//! | `wrong-bank-total` | the sum of all final balances differs from the sum of the opening balances | 3, 4, 8 together (money is neither created nor lost) |
//! | `negative-balance` | a final balance is below zero | 2 (the paying participant votes NO without funds, so COMMIT is never decided) |
//! | `liveness-bound-exceeded` | an in-doubt participant was resolved later than the bound after the final heal, or not at all | 6 (non-blocking); with a participant gone for good also 11 (said in the detail) |
//! | `stuck-after-heal` | at least the bound after the final heal, the cluster still waits for a participant's ack of a transaction (or the transaction has no decision), and that participant is not gone | 6, 11 (nothing stuck for good delays any other transaction) |
//! | `gone-participant-outcome` | a transfer begun after one of its participants was gone for good was committed (told COMMITTED, read COMMIT or applied COMMIT), or, with two participants, still had no decision at the end instead of ABORT | 2, 7, 11 |
//! | `in-doubt-at-end` | a participant that is not gone still held a prepared transaction without a decision when its store was audited at the end | 6 |
//! | `disk-full-not-recovered` | a process whose filesystem was filled did not serve again within the recovery wait after space was freed (and it was restarted if it had exited) | 6 |
//!
//! A process that stayed up on a filled filesystem and went on
//! acknowledging writes is not an anomaly by itself: its store writes into
//! file space it has already allocated (sled reuses its segments), which a
//! full filesystem does not refuse. What it acknowledged is checked like
//! everything else (`acked-commit-lost`, the apply logs, the bank total);
//! the summary counts such faults (`served while full`).
//!
//! # A participant gone for good
//!
//! The `participant-gone` nemesis kills a participant service and never
//! restarts it (its nemesis start event names the service as its target).
//! From then on exactly this is excused, and nothing else: its own in-doubt
//! resolutions and unacked decisions (liveness); a COMMIT it is missing for a
//! transaction its store still holds prepared (acked-commit-lost); and, in
//! the bank total, the work of those transactions that were decided COMMIT
//! (the other participants applied their part, it could not). Its apply log,
//! balances and in-doubt list are still read from its data directory and
//! checked like any other.
//!
//! Liveness numbers ([`Liveness`]) come from the `resolution` observations:
//! nearest-rank p50 and p99 and the maximum over the resolved ones.
//!
//! Observations (`decision-read`, `apply-log`, `balances`, `resolution`) are
//! used only when their op is `ok`; others are counted in
//! [`Stats::ignored_ops`]. When a service has several apply logs or balances,
//! the last one in the history is its final state.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::time::Duration;
use std::time::Instant;

use serde::Deserialize;
use serde::Serialize;

use crate::history::Account;
use crate::history::Applied;
use crate::history::ApplyEntry;
use crate::history::Body;
use crate::history::DecisionSeen;
use crate::history::DiskFullSeen;
use crate::history::FaultPhase;
use crate::history::InDoubtEntry;
use crate::history::Op;
use crate::history::OpType;

pub mod saga;

#[cfg(test)]
mod tests;

/// How many examples [`Report::summary`] prints per anomaly kind.
const SUMMARY_EXAMPLES: usize = 5;

/// The nemesis whose start event makes its target service gone for good.
pub const GONE_FAULT: &str = "participant-gone";

/// The verdict of a check.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[serde(rename_all = "lowercase")]
pub enum Validity {
    /// Every check ran and found nothing.
    Valid,
    /// At least one anomaly.
    Invalid,
    /// No anomaly, but some check could not be made (see
    /// [`Report::unknown_reason`]).
    #[default]
    Unknown,
}

impl Validity {
    pub fn as_str(self) -> &'static str {
        match self {
            Validity::Valid => "valid",
            Validity::Invalid => "invalid",
            Validity::Unknown => "unknown",
        }
    }
}

/// The families of anomalies; see the module documentation for each one's
/// definition and the invariant it guards.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "kebab-case")]
pub enum AnomalyKind {
    SplitOutcome,
    AppliedAgainstDecision,
    DecisionChanged,
    DecisionDiffersBetweenNodes,
    AckedCommitLost,
    AckedAbortButApplied,
    DuplicateApply,
    AppliedNeverBegun,
    WrongBankTotal,
    NegativeBalance,
    LivenessBoundExceeded,
    StuckAfterHeal,
    GoneParticipantOutcome,
    InDoubtAtEnd,
    DiskFullNotRecovered,
}

impl AnomalyKind {
    /// Every kind, in report order.
    pub const ALL: [AnomalyKind; 15] = [
        AnomalyKind::SplitOutcome,
        AnomalyKind::AppliedAgainstDecision,
        AnomalyKind::DecisionChanged,
        AnomalyKind::DecisionDiffersBetweenNodes,
        AnomalyKind::AckedCommitLost,
        AnomalyKind::AckedAbortButApplied,
        AnomalyKind::DuplicateApply,
        AnomalyKind::AppliedNeverBegun,
        AnomalyKind::WrongBankTotal,
        AnomalyKind::NegativeBalance,
        AnomalyKind::LivenessBoundExceeded,
        AnomalyKind::StuckAfterHeal,
        AnomalyKind::GoneParticipantOutcome,
        AnomalyKind::InDoubtAtEnd,
        AnomalyKind::DiskFullNotRecovered,
    ];

    /// The kebab-case name used in results.json.
    pub fn name(self) -> &'static str {
        match self {
            AnomalyKind::SplitOutcome => "split-outcome",
            AnomalyKind::AppliedAgainstDecision => "applied-against-decision",
            AnomalyKind::DecisionChanged => "decision-changed",
            AnomalyKind::DecisionDiffersBetweenNodes => "decision-differs-between-nodes",
            AnomalyKind::AckedCommitLost => "acked-commit-lost",
            AnomalyKind::AckedAbortButApplied => "acked-abort-but-applied",
            AnomalyKind::DuplicateApply => "duplicate-apply",
            AnomalyKind::AppliedNeverBegun => "applied-never-begun",
            AnomalyKind::WrongBankTotal => "wrong-bank-total",
            AnomalyKind::NegativeBalance => "negative-balance",
            AnomalyKind::LivenessBoundExceeded => "liveness-bound-exceeded",
            AnomalyKind::StuckAfterHeal => "stuck-after-heal",
            AnomalyKind::GoneParticipantOutcome => "gone-participant-outcome",
            AnomalyKind::InDoubtAtEnd => "in-doubt-at-end",
            AnomalyKind::DiskFullNotRecovered => "disk-full-not-recovered",
        }
    }

    /// The invariants of docs/design.md this kind guards, as printed in
    /// summaries.
    pub fn invariants(self) -> &'static str {
        match self {
            AnomalyKind::SplitOutcome => "3",
            AnomalyKind::AppliedAgainstDecision => "3, 5",
            AnomalyKind::DecisionChanged => "1",
            AnomalyKind::DecisionDiffersBetweenNodes => "1, 7",
            AnomalyKind::AckedCommitLost => "4",
            AnomalyKind::AckedAbortButApplied => "1, 3",
            AnomalyKind::DuplicateApply => "8",
            AnomalyKind::AppliedNeverBegun => "5, 10",
            AnomalyKind::WrongBankTotal => "3, 4, 8",
            AnomalyKind::NegativeBalance => "2",
            AnomalyKind::LivenessBoundExceeded => "6",
            AnomalyKind::StuckAfterHeal => "6, 11",
            AnomalyKind::GoneParticipantOutcome => "2, 7, 11",
            AnomalyKind::InDoubtAtEnd => "6",
            AnomalyKind::DiskFullNotRecovered => "6",
        }
    }
}

/// One anomaly: the transaction (when there is one) and what was seen.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Anomaly {
    pub txid: Option<u64>,
    pub detail: String,
}

/// Liveness of in-doubt participants after the final heal (invariant 6).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct Liveness {
    /// Number of `resolution` observations (in-doubt participants).
    pub in_doubt: usize,
    /// Nearest-rank median of the resolved ones, in ms after the heal.
    pub p50_ms: Option<u64>,
    /// Nearest-rank 99th percentile of the resolved ones.
    pub p99_ms: Option<u64>,
    /// Slowest resolved one.
    pub max_ms: Option<u64>,
    /// Resolved later than the bound, or not at all.
    pub exceeded: usize,
    /// Still in doubt when the run stopped waiting.
    pub unresolved: usize,
    /// The bound used.
    pub bound_ms: u64,
    /// Resolutions of a participant gone for good: excused, in none of the
    /// numbers above.
    #[serde(default)]
    pub excused_gone: usize,
    /// Unacked (txid, participant) pairs read at least the bound after the
    /// heal, not counting the gone participants' own.
    #[serde(default)]
    pub stuck_after_heal: usize,
}

/// Counts of what the history holds.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct Stats {
    /// History entries.
    pub ops: usize,
    /// Transfers (an invoke with its completion counts once).
    pub transfers: usize,
    /// Completed `ok`: the client was told COMMITTED.
    pub transfers_ok: usize,
    /// Completed `fail`: the client was told ABORTED (or refused).
    pub transfers_fail: usize,
    /// Completed `info` (UNKNOWN) or never completed.
    pub transfers_info: usize,
    /// Of `transfers_info`: invoked, never completed.
    pub transfers_incomplete: usize,
    /// `ok` or `fail` transfers without a txid: the client's answer could not
    /// be checked against the participants.
    pub acked_without_txid: usize,
    /// Nemesis entries (starts and stops).
    pub nemesis_events: usize,
    /// Decision reads used.
    pub decision_reads: usize,
    /// Distinct txids with at least one decision read.
    pub txids_read: usize,
    /// Services with an apply log.
    pub apply_logs: usize,
    /// Entries in those apply logs.
    pub applied_entries: usize,
    /// Services with final balances.
    pub balances_services: usize,
    /// Entries not used: observations that are not `ok`, decision reads
    /// without a txid, bank setups that are `fail` or `info`. (A completion
    /// without an invoke is not ignored: it counts as a transfer.)
    pub ignored_ops: usize,
    /// Participant services gone for good (`participant-gone`).
    #[serde(default)]
    pub gone: Vec<String>,
    /// Transactions a gone participant still held prepared at the end.
    #[serde(default)]
    pub gone_in_doubt: usize,
    /// Of those, decided COMMIT: their work there is excused from the bank
    /// total.
    #[serde(default)]
    pub gone_in_doubt_committed: usize,
    /// `disk-full` observations (one per filled process per fault).
    #[serde(default)]
    pub disk_full_observations: usize,
    /// Of those: processes that stayed up, said nothing of a full disk and
    /// went on acknowledging writes (which the loss checkers check).
    pub disk_full_served_while_full: usize,
}

/// What [`check`] found. Serialized into results.json.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub valid: Validity,
    /// Only kinds with at least one anomaly appear.
    pub anomalies: BTreeMap<AnomalyKind, Vec<Anomaly>>,
    pub liveness: Liveness,
    pub stats: Stats,
    /// Why some check could not be made (time limit, missing observations).
    /// Makes the verdict `unknown` when nothing was found; kept alongside an
    /// `invalid` verdict too, since that check was then partial.
    pub unknown_reason: Option<String>,
}

impl Report {
    /// Total number of anomalies of every kind.
    pub fn anomaly_count(&self) -> usize {
        self.anomalies.values().map(Vec::len).sum()
    }

    /// The anomalies of one kind (empty when none).
    pub fn of(&self, kind: AnomalyKind) -> &[Anomaly] {
        self.anomalies.get(&kind).map(Vec::as_slice).unwrap_or(&[])
    }

    /// A short human-readable text: the verdict, one line per anomaly kind
    /// (count and up to five examples), liveness numbers and operation counts.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        let _ = write!(out, "{}", self.valid.as_str().to_uppercase());
        if let Some(reason) = &self.unknown_reason {
            let _ = write!(out, " (incomplete: {reason})");
        }
        out.push('\n');
        for (kind, list) in &self.anomalies {
            let _ = write!(out, "{} (invariant {}): {}", kind.name(), kind.invariants(), list.len());
            let examples: Vec<String> = list.iter().take(SUMMARY_EXAMPLES).map(describe).collect();
            if !examples.is_empty() {
                let _ = write!(out, " - {}", examples.join("; "));
            }
            if list.len() > SUMMARY_EXAMPLES {
                let _ = write!(out, "; and {} more", list.len() - SUMMARY_EXAMPLES);
            }
            out.push('\n');
        }
        let l = &self.liveness;
        let _ = writeln!(
            out,
            "liveness: {} in doubt, p50 {}, p99 {}, max {}; {} over the {} ms bound, {} unresolved",
            l.in_doubt,
            ms(l.p50_ms),
            ms(l.p99_ms),
            ms(l.max_ms),
            l.exceeded,
            l.bound_ms,
            l.unresolved
        );
        if l.excused_gone > 0 || l.stuck_after_heal > 0 {
            let _ = writeln!(
                out,
                "  excused (participant gone): {}; stuck after the heal: {}",
                l.excused_gone, l.stuck_after_heal
            );
        }
        let s = &self.stats;
        let _ = writeln!(
            out,
            "ops: {}; transfers: {} (ok {}, fail {}, info {} of which {} never completed); \
             decision reads: {} ({} txids); apply logs: {} ({} entries); balances: {} services; \
             nemesis events: {}",
            s.ops,
            s.transfers,
            s.transfers_ok,
            s.transfers_fail,
            s.transfers_info,
            s.transfers_incomplete,
            s.decision_reads,
            s.txids_read,
            s.apply_logs,
            s.applied_entries,
            s.balances_services,
            s.nemesis_events
        );
        if !s.gone.is_empty() {
            let _ = writeln!(
                out,
                "gone for good: {}; held prepared there at the end: {} ({} decided COMMIT, excused from the total)",
                s.gone.join(", "),
                s.gone_in_doubt,
                s.gone_in_doubt_committed
            );
        }
        if s.disk_full_observations > 0 {
            let _ = writeln!(
                out,
                "disk-full observations: {} (served while full, writes checked like all others: {})",
                s.disk_full_observations, s.disk_full_served_while_full
            );
        }
        out
    }
}

fn describe(a: &Anomaly) -> String {
    match a.txid {
        Some(t) => format!("txid {t}: {}", a.detail),
        None => a.detail.clone(),
    }
}

fn ms(v: Option<u64>) -> String {
    match v {
        Some(v) => format!("{v} ms"),
        None => "-".to_string(),
    }
}

/// Settings of a check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckOptions {
    /// An in-doubt participant must be resolved within this many ms after the
    /// final heal (about one election timeout plus one retry interval).
    pub liveness_bound_ms: u64,
    /// Give up (verdict `unknown` unless an anomaly was already found) when
    /// the check takes longer than this. `Duration::ZERO` gives up at once.
    pub time_limit: Duration,
}

/// Checks a history; see the module documentation.
pub fn check(history: &[Op], opts: &CheckOptions) -> Report {
    let mut run = Run::new(opts);
    let budget = Budget {
        start: Instant::now(),
        limit: opts.time_limit,
    };
    if let Err(OutOfTime(phase)) = run.all_phases(history, &budget) {
        run.unknown.push(format!(
            "the time limit of {} ms ran out while {phase}",
            opts.time_limit.as_millis()
        ));
    }
    run.finish()
}

/// The time limit ran out; names the phase.
struct OutOfTime(&'static str);

struct Budget {
    start: Instant,
    limit: Duration,
}

impl Budget {
    /// Errs once the limit has run out. Called before every phase and in
    /// every loop, so a zero limit stops before any work.
    fn tick(&self, phase: &'static str) -> Result<(), OutOfTime> {
        if self.start.elapsed() >= self.limit {
            Err(OutOfTime(phase))
        } else {
            Ok(())
        }
    }
}

/// What a client was told about a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Told {
    Committed,
    Aborted,
    /// `info`, or no completion at all.
    Unknown,
}

/// One transfer: its invoke paired with its completion.
struct Transfer<'a> {
    txid: Option<u64>,
    told: Told,
    from: &'a Account,
    to: &'a Account,
    /// History index of the completion (or of the invoke if none).
    index: u64,
    /// History index of the invoke (of the completion if none was seen).
    invoked: u64,
    /// False when the invoke never got a completion.
    completed: bool,
}

impl Transfer<'_> {
    /// The participant services: one or two.
    fn services(&self) -> BTreeSet<&str> {
        [self.from.service.as_str(), self.to.service.as_str()]
            .into_iter()
            .collect()
    }
}

/// A decision read.
struct Read<'a> {
    node: &'a str,
    seen: DecisionSeen,
    index: u64,
    /// Made after the final heal (process "final").
    final_read: bool,
}

/// The history, indexed for the passes.
#[derive(Default)]
struct Index<'a> {
    transfers: Vec<Transfer<'a>>,
    /// txid -> its reads, in history order.
    reads: BTreeMap<u64, Vec<Read<'a>>>,
    /// service -> its (last) apply log.
    apply_logs: BTreeMap<&'a str, &'a [ApplyEntry]>,
    /// The (last) bank setup: service -> account -> opening balance.
    setup: Option<&'a BTreeMap<String, BTreeMap<String, i64>>>,
    /// service -> its (last) final balances.
    balances: BTreeMap<&'a str, &'a BTreeMap<String, i64>>,
    /// (txid, service, resolved_after_ms) of every resolution.
    resolutions: Vec<(Option<u64>, &'a str, Option<u64>)>,
    /// service gone for good -> history index of its `participant-gone`
    /// start (the first one).
    gone: BTreeMap<&'a str, u64>,
    /// service -> its (last) in-doubt list at the end.
    in_doubt: BTreeMap<&'a str, &'a [InDoubtEntry]>,
    /// (txid, service, decision, ms after the heal) of every unacked pair
    /// read after the heal.
    unacked: Vec<(u64, &'a str, DecisionSeen, u64)>,
    /// Every disk-full observation.
    disk: Vec<&'a DiskFullSeen>,
}

/// What the decision reads say about one txid.
#[derive(Default)]
struct ReadSummary<'a> {
    commit_nodes: BTreeSet<&'a str>,
    abort_nodes: BTreeSet<&'a str>,
}

impl ReadSummary<'_> {
    /// The decision every decided read agrees on, if they agree and there is
    /// at least one.
    fn agreed(&self) -> Option<Applied> {
        match (self.commit_nodes.is_empty(), self.abort_nodes.is_empty()) {
            (false, true) => Some(Applied::Commit),
            (true, false) => Some(Applied::Abort),
            _ => None,
        }
    }
}

/// The state of one check.
struct Run<'a> {
    opts: &'a CheckOptions,
    anomalies: BTreeMap<AnomalyKind, Vec<Anomaly>>,
    unknown: Vec<String>,
    stats: Stats,
    liveness: Liveness,
}

impl<'a> Run<'a> {
    fn new(opts: &'a CheckOptions) -> Self {
        Run {
            opts,
            anomalies: BTreeMap::new(),
            unknown: Vec::new(),
            stats: Stats::default(),
            liveness: Liveness {
                bound_ms: opts.liveness_bound_ms,
                ..Liveness::default()
            },
        }
    }

    fn report(&mut self, kind: AnomalyKind, txid: Option<u64>, detail: String) {
        self.anomalies.entry(kind).or_default().push(Anomaly { txid, detail });
    }

    fn finish(self) -> Report {
        let valid = if !self.anomalies.is_empty() {
            Validity::Invalid
        } else if !self.unknown.is_empty() {
            Validity::Unknown
        } else {
            Validity::Valid
        };
        Report {
            valid,
            anomalies: self.anomalies,
            liveness: self.liveness,
            stats: self.stats,
            unknown_reason: (!self.unknown.is_empty()).then(|| self.unknown.join("; ")),
        }
    }

    fn all_phases(&mut self, history: &[Op], budget: &Budget) -> Result<(), OutOfTime> {
        budget.tick("starting")?;
        let ix = self.index(history, budget)?;
        self.missing_observations(&ix);
        budget.tick("checking decision reads")?;
        let summaries = self.check_reads(&ix, budget)?;
        budget.tick("checking apply logs")?;
        let applied = self.check_apply_logs(&ix, &summaries, budget)?;
        budget.tick("checking client answers")?;
        self.check_client_answers(&ix, &summaries, &applied, budget)?;
        budget.tick("checking balances")?;
        self.check_bank(&ix, &summaries, budget)?;
        budget.tick("checking liveness")?;
        self.check_liveness(&ix);
        budget.tick("checking transactions stuck after the heal")?;
        self.check_stuck(&ix, budget)?;
        budget.tick("checking transfers to gone participants")?;
        self.check_gone(&ix, &summaries, &applied, budget)?;
        budget.tick("checking in-doubt lists")?;
        self.check_in_doubt(&ix);
        self.check_disk(&ix);
        Ok(())
    }

    /// Pairs transfer invokes with their completions (by process) and picks
    /// out the observations.
    fn index<'h>(&mut self, history: &'h [Op], budget: &Budget) -> Result<Index<'h>, OutOfTime> {
        let mut ix = Index::default();
        // process -> the invoke waiting for its completion.
        let mut open: BTreeMap<&str, Transfer<'h>> = BTreeMap::new();
        self.stats.ops = history.len();
        for op in history {
            budget.tick("reading the history")?;
            match &op.body {
                Body::Transfer { from, to, .. } => match op.kind {
                    OpType::Invoke => {
                        let invoke = Transfer {
                            txid: op.txid,
                            told: Told::Unknown,
                            from,
                            to,
                            index: op.index,
                            invoked: op.index,
                            completed: false,
                        };
                        if let Some(earlier) = open.insert(op.process.as_str(), invoke) {
                            // A new invoke by the same process: the earlier one
                            // never completed.
                            ix.transfers.push(earlier);
                        }
                    }
                    kind => {
                        let invoke = open.remove(op.process.as_str());
                        let told = match kind {
                            OpType::Ok => Told::Committed,
                            OpType::Fail => Told::Aborted,
                            _ => Told::Unknown,
                        };
                        ix.transfers.push(Transfer {
                            txid: op.txid.or(invoke.as_ref().and_then(|i| i.txid)),
                            told,
                            from,
                            to,
                            index: op.index,
                            invoked: invoke.map(|i| i.invoked).unwrap_or(op.index),
                            completed: true,
                        });
                    }
                },
                Body::Nemesis { fault, target, phase } => {
                    self.stats.nemesis_events += 1;
                    if fault == GONE_FAULT && *phase == FaultPhase::Start {
                        ix.gone.entry(target.as_str()).or_insert(op.index);
                    }
                }
                Body::InDoubt { service, entries } => {
                    if op.kind == OpType::Ok {
                        ix.in_doubt.insert(service, entries);
                    } else {
                        self.stats.ignored_ops += 1;
                    }
                }
                Body::Unacked {
                    service,
                    decision,
                    read_after_heal_ms,
                    ..
                } => match (op.kind, op.txid) {
                    (OpType::Ok, Some(txid)) => ix.unacked.push((txid, service, *decision, *read_after_heal_ms)),
                    _ => self.stats.ignored_ops += 1,
                },
                Body::DiskFull(seen) => {
                    if op.kind == OpType::Ok {
                        ix.disk.push(seen);
                    } else {
                        self.stats.ignored_ops += 1;
                    }
                }
                Body::BankSetup { balances } => {
                    if matches!(op.kind, OpType::Invoke | OpType::Ok) {
                        ix.setup = Some(balances);
                    } else {
                        self.stats.ignored_ops += 1;
                    }
                }
                Body::DecisionRead { node, decision } => match (op.kind, op.txid) {
                    (OpType::Ok, Some(txid)) => ix.reads.entry(txid).or_default().push(Read {
                        node,
                        seen: *decision,
                        index: op.index,
                        final_read: op.process == "final",
                    }),
                    _ => self.stats.ignored_ops += 1,
                },
                Body::ApplyLog { service, entries } => {
                    if op.kind == OpType::Ok {
                        ix.apply_logs.insert(service, entries);
                    } else {
                        self.stats.ignored_ops += 1;
                    }
                }
                Body::Balances { service, balances } => {
                    if op.kind == OpType::Ok {
                        ix.balances.insert(service, balances);
                    } else {
                        self.stats.ignored_ops += 1;
                    }
                }
                Body::Saga(_) => self.stats.ignored_ops += 1,
                Body::Resolution {
                    service,
                    resolved_after_ms,
                } => {
                    if op.kind == OpType::Ok {
                        ix.resolutions.push((op.txid, service, *resolved_after_ms));
                    } else {
                        self.stats.ignored_ops += 1;
                    }
                }
            }
        }
        let mut never_completed: Vec<Transfer> = open.into_values().collect();
        never_completed.sort_by_key(|t| t.index);
        ix.transfers.extend(never_completed);

        let s = &mut self.stats;
        s.transfers = ix.transfers.len();
        for t in &ix.transfers {
            match t.told {
                Told::Committed => s.transfers_ok += 1,
                Told::Aborted => s.transfers_fail += 1,
                Told::Unknown => s.transfers_info += 1,
            }
            if !t.completed {
                s.transfers_incomplete += 1;
            }
            if t.told != Told::Unknown && t.txid.is_none() {
                s.acked_without_txid += 1;
            }
        }
        s.decision_reads = ix.reads.values().map(Vec::len).sum();
        s.txids_read = ix.reads.len();
        s.apply_logs = ix.apply_logs.len();
        s.applied_entries = ix.apply_logs.values().map(|l| l.len()).sum();
        s.balances_services = ix.balances.len();
        s.gone = ix.gone.keys().map(|g| g.to_string()).collect();
        s.disk_full_observations = ix.disk.len();
        // Stayed up on a full filesystem and went on writing (into space
        // it had already allocated): its writes are checked like all others.
        s.disk_full_served_while_full = ix
            .disk
            .iter()
            .filter(|d| !d.exited && d.disk_messages == 0 && d.writes_while_full > 0)
            .count();
        Ok(ix)
    }

    /// Notes the observations whose absence leaves checks undone.
    fn missing_observations(&mut self, ix: &Index) {
        if ix.apply_logs.is_empty() {
            self.unknown
                .push("no apply log in the history: participant outcomes were not checked".to_string());
        } else {
            let mut services: BTreeSet<&str> = ix.transfers.iter().flat_map(|t| t.services()).collect();
            if let Some(setup) = ix.setup {
                services.extend(setup.keys().map(String::as_str));
            }
            let missing: Vec<&str> = services
                .into_iter()
                .filter(|s| !ix.apply_logs.contains_key(s))
                .collect();
            if !missing.is_empty() {
                self.unknown.push(format!(
                    "no apply log for {}: its outcomes were not checked",
                    missing.join(", ")
                ));
            }
        }
    }

    /// decision-changed and decision-differs-between-nodes; returns what the
    /// reads say per txid.
    fn check_reads<'h>(
        &mut self,
        ix: &Index<'h>,
        budget: &Budget,
    ) -> Result<BTreeMap<u64, ReadSummary<'h>>, OutOfTime> {
        let mut summaries = BTreeMap::new();
        for (&txid, reads) in &ix.reads {
            budget.tick("checking decision reads")?;
            let mut summary = ReadSummary::default();
            // node -> the first decided outcome it returned (read index).
            let mut decided: BTreeMap<&str, (DecisionSeen, u64)> = BTreeMap::new();
            // Report at most one change per node.
            let mut changed: BTreeSet<&str> = BTreeSet::new();
            for read in reads {
                match read.seen {
                    DecisionSeen::Commit => {
                        summary.commit_nodes.insert(read.node);
                    }
                    DecisionSeen::Abort => {
                        summary.abort_nodes.insert(read.node);
                    }
                    DecisionSeen::Pending | DecisionSeen::Unknown => {}
                }
                let Some(&(first, first_index)) = decided.get(read.node) else {
                    if matches!(read.seen, DecisionSeen::Commit | DecisionSeen::Abort) {
                        decided.insert(read.node, (read.seen, read.index));
                    }
                    continue;
                };
                let broken = match read.seen {
                    DecisionSeen::Commit | DecisionSeen::Abort => read.seen != first,
                    DecisionSeen::Pending => true,
                    // Forgotten after every ack (invariant 10).
                    DecisionSeen::Unknown => false,
                };
                if broken && changed.insert(read.node) {
                    self.report(
                        AnomalyKind::DecisionChanged,
                        Some(txid),
                        format!(
                            "node {} read {} (op {first_index}) and later {} (op {})",
                            read.node,
                            seen_name(first),
                            seen_name(read.seen),
                            read.index
                        ),
                    );
                }
            }
            // One node answering both is decision-changed, reported above.
            let c = &summary.commit_nodes;
            let a = &summary.abort_nodes;
            if two_different(c, a) {
                self.report(
                    AnomalyKind::DecisionDiffersBetweenNodes,
                    Some(txid),
                    format!("COMMIT from {}, ABORT from {}", join(c), join(a)),
                );
            }
            summaries.insert(txid, summary);
        }
        Ok(summaries)
    }

    /// split-outcome, applied-against-decision, duplicate-apply and
    /// applied-never-begun; returns txid -> service -> outcomes applied.
    fn check_apply_logs<'h>(
        &mut self,
        ix: &Index<'h>,
        reads: &BTreeMap<u64, ReadSummary>,
        budget: &Budget,
    ) -> Result<AppliedMap<'h>, OutOfTime> {
        let mut applied: AppliedMap<'h> = BTreeMap::new();
        for (&service, entries) in &ix.apply_logs {
            for e in entries.iter() {
                budget.tick("reading apply logs")?;
                applied
                    .entry(e.txid)
                    .or_default()
                    .entry(service)
                    .or_default()
                    .push(e.outcome);
            }
        }
        let mut mentioned: BTreeSet<u64> = ix.transfers.iter().filter_map(|t| t.txid).collect();
        mentioned.extend(ix.reads.keys());

        for (&txid, by_service) in &applied {
            budget.tick("checking apply logs")?;
            let mut committed = BTreeSet::new();
            let mut aborted = BTreeSet::new();
            for (&service, outcomes) in by_service {
                if outcomes.len() > 1 {
                    let list: Vec<&str> = outcomes.iter().map(|o| applied_name(*o)).collect();
                    self.report(
                        AnomalyKind::DuplicateApply,
                        Some(txid),
                        format!("{service} applied it {} times: {}", outcomes.len(), list.join(", ")),
                    );
                }
                if outcomes.contains(&Applied::Commit) {
                    committed.insert(service);
                }
                if outcomes.contains(&Applied::Abort) {
                    aborted.insert(service);
                }
            }
            // One service applying both is a duplicate apply, reported above.
            if two_different(&committed, &aborted) {
                self.report(
                    AnomalyKind::SplitOutcome,
                    Some(txid),
                    format!(
                        "COMMIT applied at {}, ABORT applied at {}",
                        join(&committed),
                        join(&aborted)
                    ),
                );
            }
            if let Some(decision) = reads.get(&txid).and_then(ReadSummary::agreed) {
                let against = match decision {
                    Applied::Commit => &aborted,
                    Applied::Abort => &committed,
                };
                if !against.is_empty() {
                    self.report(
                        AnomalyKind::AppliedAgainstDecision,
                        Some(txid),
                        format!(
                            "the decision read is {} but {} applied {}",
                            applied_name(decision),
                            join(against),
                            applied_name(opposite(decision))
                        ),
                    );
                }
            }
            // An ABORT no caller learned the txid of is the presumed abort
            // of a one-write commit whose leader died before its write
            // (ADR 0012): its caller got UNKNOWN without a txid, and the
            // participants, asking, were told "unknown". A COMMIT nobody
            // began is an anomaly.
            if !mentioned.contains(&txid) && !committed.is_empty() {
                self.report(
                    AnomalyKind::AppliedNeverBegun,
                    Some(txid),
                    format!(
                        "COMMIT applied at {} but no transfer or decision read mentions it",
                        join(&committed)
                    ),
                );
            }
        }
        Ok(applied)
    }

    /// acked-commit-lost and acked-abort-but-applied.
    fn check_client_answers(
        &mut self,
        ix: &Index,
        reads: &BTreeMap<u64, ReadSummary>,
        applied: &AppliedMap,
        budget: &Budget,
    ) -> Result<(), OutOfTime> {
        // txid -> participant services of the transfers told COMMITTED.
        let mut committed: BTreeMap<u64, BTreeSet<&str>> = BTreeMap::new();
        // txid -> first op told COMMITTED / ABORTED.
        let mut told_commit: BTreeMap<u64, u64> = BTreeMap::new();
        let mut told_abort: BTreeMap<u64, u64> = BTreeMap::new();
        for t in &ix.transfers {
            let Some(txid) = t.txid else { continue };
            match t.told {
                Told::Committed => {
                    committed.entry(txid).or_default().extend(t.services());
                    told_commit.entry(txid).or_insert(t.index);
                }
                Told::Aborted => {
                    told_abort.entry(txid).or_insert(t.index);
                }
                Told::Unknown => {}
            }
        }
        let no_outcomes = BTreeMap::new();

        for (&txid, services) in &committed {
            budget.tick("checking COMMITTED answers")?;
            let mut why = Vec::new();
            if let Some(r) = reads.get(&txid) {
                if !r.abort_nodes.is_empty() {
                    why.push(format!("ABORT read from {}", join(&r.abort_nodes)));
                }
            }
            let outcomes = applied.get(&txid).unwrap_or(&no_outcomes);
            for &service in services {
                if !ix.apply_logs.contains_key(service) {
                    continue; // not observed; noted as missing
                }
                let here = outcomes.get(service).map(Vec::as_slice).unwrap_or(&[]);
                if !here.contains(&Applied::Commit) && !held_by_gone(ix, service, txid) {
                    why.push(format!("{service} has no COMMIT"));
                }
                if here.contains(&Applied::Abort) {
                    why.push(format!("{service} applied ABORT"));
                }
            }
            if !why.is_empty() {
                let op = told_commit.get(&txid).copied().unwrap_or_default();
                self.report(
                    AnomalyKind::AckedCommitLost,
                    Some(txid),
                    format!("client told COMMITTED (op {op}), but {}", why.join(", ")),
                );
            }
        }

        for (&txid, &op) in &told_abort {
            budget.tick("checking ABORTED answers")?;
            let mut why = Vec::new();
            if let Some(&other) = told_commit.get(&txid) {
                why.push(format!("a client was told COMMITTED (op {other})"));
            }
            commit_evidence(txid, reads, applied, &mut why);
            if !why.is_empty() {
                self.report(
                    AnomalyKind::AckedAbortButApplied,
                    Some(txid),
                    format!("client told ABORTED (op {op}), but {}", why.join(", ")),
                );
            }
        }
        Ok(())
    }

    /// negative-balance and wrong-bank-total.
    fn check_bank(&mut self, ix: &Index, reads: &BTreeMap<u64, ReadSummary>, budget: &Budget) -> Result<(), OutOfTime> {
        for (&service, balances) in &ix.balances {
            for (account, &value) in balances.iter() {
                budget.tick("checking balances")?;
                if value < 0 {
                    self.report(
                        AnomalyKind::NegativeBalance,
                        None,
                        format!("{service}/{account} ends at {value}"),
                    );
                }
            }
        }
        let Some(setup) = ix.setup else {
            self.unknown
                .push("no bank-setup in the history: the bank total was not checked".to_string());
            return Ok(());
        };
        let missing: Vec<&str> = setup
            .keys()
            .map(String::as_str)
            .filter(|s| !ix.balances.contains_key(s))
            .collect();
        if !missing.is_empty() {
            self.unknown.push(format!(
                "no final balances for {}: the bank total was not checked",
                missing.join(", ")
            ));
            return Ok(());
        }
        // i128: no sum of i64 values overflows it.
        let opening: i128 = setup.values().flat_map(|a| a.values()).map(|&v| i128::from(v)).sum();
        let closing: i128 = ix
            .balances
            .values()
            .flat_map(|a| a.values())
            .map(|&v| i128::from(v))
            .sum();
        // A participant gone for good could not apply its part of the
        // transactions it holds prepared; those decided COMMIT had the other
        // parts applied, so the total is off by exactly the gone part.
        let mut gone_part: i128 = 0;
        let mut unreadable = Vec::new();
        for &service in ix.gone.keys() {
            let Some(entries) = ix.in_doubt.get(service) else {
                self.unknown.push(format!(
                    "no in-doubt list of {service} (gone): the bank total was not checked"
                ));
                return Ok(());
            };
            self.stats.gone_in_doubt += entries.len();
            for e in entries.iter() {
                budget.tick("checking balances")?;
                if reads.get(&e.txid).and_then(ReadSummary::agreed) != Some(Applied::Commit) {
                    continue;
                }
                self.stats.gone_in_doubt_committed += 1;
                match &e.work {
                    Some(work) => gone_part += work.iter().map(|(_, d)| i128::from(*d)).sum::<i128>(),
                    None => unreadable.push(e.txid),
                }
            }
        }
        if !unreadable.is_empty() {
            self.unknown.push(format!(
                "the prepared work of {} committed transaction(s) held by a gone participant is unknown (e.g. txid {}): \
                 the bank total was not checked",
                unreadable.len(),
                unreadable[0]
            ));
            return Ok(());
        }
        let expected = opening - gone_part;
        if expected != closing {
            let excuse = if gone_part != 0 {
                format!(
                    " ({gone_part:+} of committed work a gone participant holds prepared is excused: expected {expected})"
                )
            } else {
                String::new()
            };
            self.report(
                AnomalyKind::WrongBankTotal,
                None,
                format!(
                    "opening total {opening}, final total {closing} (difference {}){excuse}",
                    closing - opening
                ),
            );
        }
        Ok(())
    }

    /// liveness-bound-exceeded and the liveness numbers.
    fn check_liveness(&mut self, ix: &Index) {
        let bound = self.opts.liveness_bound_ms;
        let mut resolved = Vec::new();
        let mut exceeded = 0;
        let mut unresolved = 0;
        let mut excused = 0;
        // With a participant gone for good, the others' liveness is also
        // invariant 11: its stuck transactions must not delay them.
        let gone = if ix.gone.is_empty() {
            String::new()
        } else {
            format!(
                " (gone for good: {}; invariant 11)",
                join(&ix.gone.keys().copied().collect())
            )
        };
        for &(txid, service, after) in &ix.resolutions {
            if ix.gone.contains_key(service) {
                excused += 1;
                continue;
            }
            match after {
                Some(ms) => {
                    resolved.push(ms);
                    if ms > bound {
                        exceeded += 1;
                        self.report(
                            AnomalyKind::LivenessBoundExceeded,
                            txid,
                            format!("{service} resolved it {ms} ms after the heal (bound {bound} ms){gone}"),
                        );
                    }
                }
                None => {
                    exceeded += 1;
                    unresolved += 1;
                    self.report(
                        AnomalyKind::LivenessBoundExceeded,
                        txid,
                        format!("{service} was still in doubt when the run stopped waiting{gone}"),
                    );
                }
            }
        }
        resolved.sort_unstable();
        self.liveness = Liveness {
            in_doubt: ix.resolutions.len() - excused,
            p50_ms: nearest_rank(&resolved, 50),
            p99_ms: nearest_rank(&resolved, 99),
            max_ms: resolved.last().copied(),
            exceeded,
            unresolved,
            bound_ms: bound,
            excused_gone: excused,
            stuck_after_heal: 0,
        };
    }

    /// stuck-after-heal: every pair the cluster still waited on at least the
    /// bound after the heal, except a gone participant's own and the pairs
    /// the liveness measurement already reported.
    fn check_stuck(&mut self, ix: &Index, budget: &Budget) -> Result<(), OutOfTime> {
        let bound = self.opts.liveness_bound_ms;
        let measured: BTreeSet<(u64, &str)> = ix
            .resolutions
            .iter()
            .filter_map(|&(txid, service, _)| Some((txid?, service)))
            .collect();
        let mut stuck = 0;
        for &(txid, service, decision, after_ms) in &ix.unacked {
            budget.tick("checking transactions stuck after the heal")?;
            if ix.gone.contains_key(service) {
                continue;
            }
            stuck += 1;
            if after_ms < bound || measured.contains(&(txid, service)) {
                continue;
            }
            let what = match decision {
                DecisionSeen::Pending => "the transaction still had no decision".to_string(),
                d => format!("{service} had not acked {}", seen_name(d)),
            };
            let gone = if ix.gone.is_empty() {
                String::new()
            } else {
                format!(" (gone for good: {})", join(&ix.gone.keys().copied().collect()))
            };
            self.report(
                AnomalyKind::StuckAfterHeal,
                Some(txid),
                format!("{after_ms} ms after the final heal (bound {bound} ms) {what}{gone}"),
            );
        }
        self.liveness.stuck_after_heal = stuck;
        Ok(())
    }

    /// gone-participant-outcome: transfers begun after one of their
    /// participants was gone for good.
    fn check_gone(
        &mut self,
        ix: &Index,
        reads: &BTreeMap<u64, ReadSummary>,
        applied: &AppliedMap,
        budget: &Budget,
    ) -> Result<(), OutOfTime> {
        if ix.gone.is_empty() {
            return Ok(());
        }
        for t in &ix.transfers {
            budget.tick("checking transfers to gone participants")?;
            let services = t.services();
            let Some(gone) = services
                .iter()
                .copied()
                .find(|s| ix.gone.get(s).is_some_and(|&at| at < t.invoked))
            else {
                continue;
            };
            let mut why = Vec::new();
            if t.told == Told::Committed {
                why.push("the client was told COMMITTED".to_string());
            }
            let Some(txid) = t.txid else {
                if !why.is_empty() {
                    self.report(
                        AnomalyKind::GoneParticipantOutcome,
                        None,
                        format!("transfer (op {}) with {gone} gone: {}", t.index, why.join(", ")),
                    );
                }
                continue;
            };
            commit_evidence(txid, reads, applied, &mut why);
            // Two participants: the live one's NO-or-no-answer must end in
            // ABORT. One participant (one-phase): only it can decide, so it
            // may stay undecided for good.
            if services.len() == 2 {
                let last_final = ix
                    .reads
                    .get(&txid)
                    .and_then(|rs| rs.iter().rev().find(|r| r.final_read))
                    .map(|r| r.seen);
                if last_final == Some(DecisionSeen::Pending) {
                    why.push("the final reads found no decision (stuck instead of aborted)".to_string());
                }
            }
            if !why.is_empty() {
                self.report(
                    AnomalyKind::GoneParticipantOutcome,
                    Some(txid),
                    format!("begun after {gone} was gone for good, but {}", why.join(", ")),
                );
            }
        }
        Ok(())
    }

    /// in-doubt-at-end: a participant that is not gone kept a prepared,
    /// undecided transaction to the end. Also a gone participant holding a
    /// transaction begun after it was gone (it cannot have prepared it).
    fn check_in_doubt(&mut self, ix: &Index) {
        let begun_after: BTreeMap<&str, BTreeSet<u64>> = ix
            .gone
            .iter()
            .map(|(&g, &at)| {
                let txids = ix
                    .transfers
                    .iter()
                    .filter(|t| t.invoked > at && t.services().contains(g))
                    .filter_map(|t| t.txid)
                    .collect();
                (g, txids)
            })
            .collect();
        for (&service, entries) in &ix.in_doubt {
            for e in entries.iter() {
                match begun_after.get(service) {
                    None => self.report(
                        AnomalyKind::InDoubtAtEnd,
                        Some(e.txid),
                        format!("{service} still held it prepared, without a decision, at the end"),
                    ),
                    Some(after) if after.contains(&e.txid) => self.report(
                        AnomalyKind::InDoubtAtEnd,
                        Some(e.txid),
                        format!("{service} holds it prepared, but it was begun after {service} was gone"),
                    ),
                    Some(_) => {}
                }
            }
        }
    }

    /// disk-full-not-recovered.
    fn check_disk(&mut self, ix: &Index) {
        for d in &ix.disk {
            if d.back_after_ms.is_none() {
                let how = if d.restarted {
                    "restarted after space was freed"
                } else {
                    "still running when space was freed"
                };
                self.report(
                    AnomalyKind::DiskFullNotRecovered,
                    None,
                    format!(
                        "{} ({how}) did not serve again within {} ms{}",
                        d.process,
                        d.recovery_wait_ms,
                        d.first_message
                            .as_ref()
                            .map(|m| format!("; it said: {m}"))
                            .unwrap_or_default()
                    ),
                );
            }
        }
    }
}

/// Adds to `why` what shows that `txid` was committed: nodes that read
/// COMMIT, services that applied COMMIT.
fn commit_evidence(txid: u64, reads: &BTreeMap<u64, ReadSummary>, applied: &AppliedMap, why: &mut Vec<String>) {
    if let Some(r) = reads.get(&txid) {
        if !r.commit_nodes.is_empty() {
            why.push(format!("COMMIT read from {}", join(&r.commit_nodes)));
        }
    }
    if let Some(outcomes) = applied.get(&txid) {
        let at: BTreeSet<&str> = outcomes
            .iter()
            .filter(|(_, o)| o.contains(&Applied::Commit))
            .map(|(s, _)| *s)
            .collect();
        if !at.is_empty() {
            why.push(format!("COMMIT applied at {}", join(&at)));
        }
    }
}

/// Whether `service` is gone for good and its store still holds `txid`
/// prepared: its missing COMMIT is then excused. Without its in-doubt list
/// this cannot be told, and the verdict is unknown (see `check_bank`).
fn held_by_gone(ix: &Index, service: &str, txid: u64) -> bool {
    ix.gone.contains_key(service)
        && ix
            .in_doubt
            .get(service)
            .is_none_or(|entries| entries.iter().any(|e| e.txid == txid))
}

/// txid -> service -> outcomes it applied, in apply-log order.
type AppliedMap<'h> = BTreeMap<u64, BTreeMap<&'h str, Vec<Applied>>>;

/// The nearest-rank percentile `p` (1..=100) of sorted values: the value at
/// rank ceil(p/100 * n).
pub fn nearest_rank(sorted: &[u64], p: u32) -> Option<u64> {
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    let rank = (p as usize * n).div_ceil(100).clamp(1, n);
    sorted.get(rank - 1).copied()
}

/// Whether some member of `a` and some member of `b` are different names
/// (nodes or services).
fn two_different(a: &BTreeSet<&str>, b: &BTreeSet<&str>) -> bool {
    a.iter().any(|x| b.iter().any(|y| x != y))
}

fn join(set: &BTreeSet<&str>) -> String {
    set.iter().copied().collect::<Vec<_>>().join(", ")
}

fn seen_name(d: DecisionSeen) -> &'static str {
    match d {
        DecisionSeen::Commit => "COMMIT",
        DecisionSeen::Abort => "ABORT",
        DecisionSeen::Pending => "PENDING",
        DecisionSeen::Unknown => "UNKNOWN",
    }
}

fn applied_name(a: Applied) -> &'static str {
    match a {
        Applied::Commit => "COMMIT",
        Applied::Abort => "ABORT",
    }
}

fn opposite(a: Applied) -> Applied {
    match a {
        Applied::Commit => Applied::Abort,
        Applied::Abort => Applied::Commit,
    }
}
