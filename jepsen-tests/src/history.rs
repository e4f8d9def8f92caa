//! The history of a run: one JSON object per line, in the order the runner
//! recorded them, the way Jepsen records operations.
//!
//! Every client operation appears twice: an `invoke` when it starts and one
//! completion with the same `process`: `ok` (it happened), `fail` (it
//! certainly did not happen) or `info` (unknown: it may or may not have
//! happened; never counted as a failure). Nemesis events and the final
//! observations (decision reads, apply logs, balances, in-doubt resolution)
//! are recorded as operations too, so the checkers read one file.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::io::Write;

use serde::Deserialize;
use serde::Serialize;

/// The kind of a history entry.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum OpType {
    Invoke,
    Ok,
    Fail,
    Info,
}

/// One account of the bank: which participant service holds it, and its name.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Account {
    pub service: String,
    pub account: String,
}

/// A decision as a reader saw it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "UPPERCASE")]
pub enum DecisionSeen {
    Commit,
    Abort,
    /// Begun, no decision yet.
    Pending,
    /// No record: never begun or forgotten (presumed abort).
    Unknown,
}

/// An outcome a participant applied.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "UPPERCASE")]
pub enum Applied {
    Commit,
    Abort,
}

/// One line of a participant's apply log, in the order it applied them.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ApplyEntry {
    pub txid: u64,
    pub outcome: Applied,
}

/// Whether a nemesis event starts or ends a fault.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum FaultPhase {
    Start,
    Stop,
}

/// What an operation was about. Serialized as `"f": name, "value": {...}`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "f", content = "value", rename_all = "kebab-case")]
pub enum Body {
    /// The bank before the run: every account and its opening balance.
    BankSetup {
        balances: BTreeMap<String, BTreeMap<String, i64>>,
    },
    /// A client's transfer under one transaction. ok = the coordinator said
    /// COMMITTED; fail = ABORTED (or refused before anything began);
    /// info = UNKNOWN.
    Transfer { from: Account, to: Account, amount: i64 },
    /// A fault injected or healed by the nemesis (`process` = "nemesis").
    Nemesis {
        fault: String,
        target: String,
        phase: FaultPhase,
    },
    /// A linearizable decision read of `txid` from one coordinator node.
    DecisionRead { node: String, decision: DecisionSeen },
    /// Every outcome one participant service applied, in order.
    ApplyLog { service: String, entries: Vec<ApplyEntry> },
    /// One participant service's balances at the end.
    Balances {
        service: String,
        balances: BTreeMap<String, i64>,
    },
    /// After the final heal: when an in-doubt transaction of `service` was
    /// resolved, in ms after the heal; `None` = still in doubt when the run
    /// stopped waiting.
    Resolution {
        service: String,
        resolved_after_ms: Option<u64>,
    },
    /// One participant service's durable log at the end: every transaction
    /// it holds prepared (voted YES) with no decision applied, and the work
    /// (account, delta) it prepared for it, when readable.
    InDoubt {
        service: String,
        entries: Vec<InDoubtEntry>,
    },
    /// The cluster's record of `txid` (the op's txid), read at least the
    /// liveness bound after the final heal: participant `service` has not
    /// acked its decision, or the transaction has none (`decision` PENDING).
    Unacked {
        service: String,
        decision: DecisionSeen,
        read_after_heal_ms: u64,
        /// Deliveries the answering leader had tried to it (leader-local).
        #[serde(default)]
        delivery_attempts: u32,
    },
    /// What one process whose data directory was on the filled filesystem
    /// did during a `disk-full` fault (`process` "nemesis", type `ok`).
    DiskFull(DiskFullSeen),
    /// The saga workload's operations (`--workload saga`, see
    /// [`SagaEvent`]); the transfer checkers ignore them.
    Saga(SagaEvent),
}

/// What the saga workload records.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "saga", rename_all = "kebab-case")]
pub enum SagaEvent {
    /// A client's StartSaga of one order (key = the order): an `invoke`,
    /// then `ok` with the saga id, `fail` (refused) or `info` (UNKNOWN: it
    /// may have started; retried with the same key). `kind` is what the
    /// client meant: `good`, `out-of-stock` or `unpayable`.
    Start {
        order: String,
        kind: String,
        qty: u64,
        amount: u64,
        /// 1 for the first try of this order, 2.. for retries of an
        /// UNKNOWN start with the same key.
        attempt: u32,
        saga_id: Option<u64>,
    },
    /// After the final heal and the settle wait: one saga as ListSagas
    /// reported it (`process` "final").
    Final(SagaSeen),
    /// The settle wait: how long it took, and whether every saga the
    /// cluster holds had ended (COMPLETED, COMPENSATED or PARKED) and the
    /// final listing was read at all.
    Settle {
        waited_ms: u64,
        all_ended: bool,
        read: bool,
    },
    /// One stopped step service's audit (`dtx-dev saga-step-audit`);
    /// `error` when it could not be read.
    Audit {
        role: String,
        audit: Option<dtx_saga_shop::Audit>,
        error: Option<String>,
    },
}

/// One saga at the end of a run, from its journal.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct SagaSeen {
    pub saga_id: u64,
    /// The idempotency key: the order.
    pub key: String,
    /// RUNNING, COMPENSATING, COMPLETED, COMPENSATED or PARKED.
    pub state: String,
    pub parked_reason: String,
    /// Calls (forward and compensation) with a journal entry.
    pub calls: u64,
    /// Calls whose outcome was UNKNOWN for a while (`unknown_ms` > 0, or
    /// still UNKNOWN), their summed and longest UNKNOWN time, ms.
    pub unknown_calls: u64,
    pub unknown_ms_sum: u64,
    pub unknown_ms_max: u64,
    /// Status queries that settled an UNKNOWN call (summed over calls).
    pub reconciliations: u64,
    /// Operator actions recorded (none are made by the harness).
    pub operator_actions: u64,
}

/// A prepared, undecided transaction in a participant's log at the end.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct InDoubtEntry {
    pub txid: u64,
    /// The work prepared for it: (account, delta). `None` when the
    /// participant's store did not say.
    pub work: Option<Vec<(String, i64)>>,
}

/// One filled process in one `disk-full` fault.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct DiskFullSeen {
    /// "n2" (a coordinator node) or a bank service id.
    pub process: String,
    /// Bytes the filler wrote before the filesystem said ENOSPC.
    pub filled_bytes: u64,
    /// How long the filesystem stayed full, ms.
    pub full_ms: u64,
    /// The process was not running any more when space was freed.
    pub exited: bool,
    /// Lines it logged while full that name the full disk (no space left,
    /// os error 28, disk full, ENOSPC), and the first of them.
    pub disk_messages: u64,
    pub first_message: Option<String>,
    /// Writes through it while full: probe transfers (banks) that were
    /// committed, or Raft log entries it appended (nodes).
    pub writes_while_full: u64,
    /// Probe transfers (banks) that were refused while full, or calls the
    /// node refused.
    pub refused_while_full: u64,
    /// The harness restarted it after freeing space (it had exited).
    pub restarted: bool,
    /// ms from freeing space until it served again (a bank committed a
    /// probe transfer; a node caught up with the others); `None` = not
    /// within the recovery wait.
    pub back_after_ms: Option<u64>,
    /// The recovery wait, ms.
    pub recovery_wait_ms: u64,
    /// The last line of its log at the end of the recovery wait.
    #[serde(default)]
    pub last_log_line: Option<String>,
}

/// One history entry.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Op {
    /// Position in the history, from 0.
    pub index: u64,
    /// Nanoseconds since the run started (monotonic clock).
    pub time_ns: u64,
    /// Who did it: "client-3", "nemesis", "final".
    pub process: String,
    #[serde(rename = "type")]
    pub kind: OpType,
    /// The transaction, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub txid: Option<u64>,
    #[serde(flatten)]
    pub body: Body,
    /// Why it failed or is unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("history line {line}: {source}")]
    Parse { line: usize, source: serde_json::Error },
    #[error("reading history: {0}")]
    Io(#[from] std::io::Error),
}

/// Writes one op per line.
pub fn write_jsonl(out: &mut impl Write, ops: &[Op]) -> std::io::Result<()> {
    for op in ops {
        serde_json::to_writer(&mut *out, op)?;
        out.write_all(b"\n")?;
    }
    Ok(())
}

/// Reads a JSON-lines history; blank lines are skipped, and a bad line is an
/// error that names its line number.
pub fn read_jsonl(input: impl BufRead) -> Result<Vec<Op>, HistoryError> {
    let mut ops = Vec::new();
    for (i, line) in input.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let op = serde_json::from_str(&line).map_err(|source| HistoryError::Parse { line: i + 1, source })?;
        ops.push(op);
    }
    Ok(ops)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_json_lines() {
        let ops = vec![
            Op {
                index: 0,
                time_ns: 5,
                process: "client-0".into(),
                kind: OpType::Invoke,
                txid: None,
                body: Body::Transfer {
                    from: Account {
                        service: "bank-a".into(),
                        account: "a1".into(),
                    },
                    to: Account {
                        service: "bank-b".into(),
                        account: "b1".into(),
                    },
                    amount: 3,
                },
                error: None,
            },
            Op {
                index: 1,
                time_ns: 9,
                process: "client-0".into(),
                kind: OpType::Info,
                txid: Some(7),
                body: Body::Transfer {
                    from: Account {
                        service: "bank-a".into(),
                        account: "a1".into(),
                    },
                    to: Account {
                        service: "bank-b".into(),
                        account: "b1".into(),
                    },
                    amount: 3,
                },
                error: Some("timed out".into()),
            },
        ];
        let mut buf = Vec::new();
        write_jsonl(&mut buf, &ops).unwrap();
        let text = String::from_utf8(buf.clone()).unwrap();
        assert!(text.contains("\"type\":\"info\""), "{text}");
        assert!(text.contains("\"f\":\"transfer\""), "{text}");
        assert_eq!(read_jsonl(&buf[..]).unwrap(), ops);
    }

    #[test]
    fn a_bad_line_names_its_number() {
        let err = read_jsonl(&b"\n{\"nope\":1}\n"[..]).unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
    }
}
