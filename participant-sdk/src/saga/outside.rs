//! Steps that call a system outside the step service (ADR 0034): a payment
//! provider, a mail sender, a partner's API. Such a call cannot be part of
//! the service's own atomic write, so the store keeps it in three durable
//! stages under the operation id:
//!
//! 1. **in flight**: before the outside call, an [`InFlight`] record (the
//!    call, the outside system's name and the exact request) replaces
//!    "nothing" in the inbox, durably. Nothing is ever sent outside without
//!    it, so an operation id with no record was never sent.
//! 2. the outside call, under the operation id as the outside system's
//!    **idempotency key**, with no lock and no database transaction held;
//! 3. **answered**: the outside system's answer, turned into the step's
//!    result by the handler (which stages its local writes), replaces the
//!    in-flight record in one atomic write, as any other answer.
//!
//! An outside call that gets no answer (a timeout, a lost reply, a refused
//! connection) leaves the record in flight and the call answers an error
//! (UNKNOWN to the orchestrator). From then on only the outside system can
//! say what happened: Status and Fence of an in-flight operation ask its
//! **status hook** ([`OutsideSystem::status`]) and
//! - [`OutsideStatus::Done`]: record its answer (as in stage 3) and answer
//!   it;
//! - [`OutsideStatus::NotDone`]: Status answers "not applied" (the record
//!   stays in flight, and a repeated call sends the same request again
//!   under the same key); Fence asked the hook to *fence* the key (the
//!   outside system refuses it from then on), so "not done" is final and
//!   the step is recorded FAILED (fenced);
//! - [`OutsideStatus::Unknown`]: an error, the record stays in flight;
//!   never FAILED, never fenced.

use super::codec::put_str;
use super::codec::take;
use super::codec::take_str;
use super::codec::take_u64;
use super::rules::check_repeat_only;
use super::rules::FENCED_OUTSIDE_REASON;
use super::types::Authorization;
use super::types::CallKind;
use super::types::StepCall;
use super::types::StepError;
use super::types::StepOutput;
use super::types::StepRecord;
use super::types::StepResult;
use crate::store::unix_ms;

/// The format byte of an in-flight record (an answered one's is
/// `RECORD_FORMAT`, 1): both live under the operation id's inbox key.
pub(crate) const IN_FLIGHT_FORMAT: u8 = 2;

/// What an outside system says about one idempotency key, when asked
/// ([`OutsideSystem::status`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutsideStatus {
    /// It answered a call under the key: its answer, whatever it was (done,
    /// declined, refused because the key was fenced), in the outside
    /// system's encoding, as [`OutsideSystem::call`] would have returned
    /// it. The handler turns it into the step's result.
    Done(Vec<u8>),
    /// It holds nothing under the key. Asked with `fence`, this must also
    /// mean "and never will": the outside system now refuses the key (and
    /// answers a later status query with that refusal).
    NotDone,
    /// It cannot tell now (unreachable, no answer in time, an error).
    Unknown(String),
}

/// An outside system a step service calls, as the step service's code
/// reaches it: the call and the status hook. Both take the idempotency key
/// (the step's operation id) and the request exactly as the in-flight
/// record holds it.
#[tonic::async_trait]
pub trait OutsideSystem: Send + Sync {
    /// Its name, for records, errors and logs ("payment provider").
    fn name(&self) -> &str;

    /// Sends `request` under idempotency key `key`. `Ok(answer)`: the
    /// outside system answered (whatever it said); `Err(why)`: no answer (a
    /// timeout, a lost reply, a connection refused or cut): it may or may
    /// not have acted, and the operation stays in flight. Must be bounded
    /// in time (shorter than the orchestrator's `saga.call_timeout_ms`).
    async fn call(&self, key: &str, request: &[u8]) -> Result<Vec<u8>, String>;

    /// The status hook: what happened to `key` there. With `fence`, "not
    /// done" must be made final by the outside system (it refuses the key
    /// from now on, so a request still on its way can never act); an
    /// outside system that cannot promise that answers `Unknown` to a
    /// fencing question, and the saga parks for an operator instead of
    /// failing a step that may yet happen. Must be bounded in time.
    async fn status(&self, key: &str, request: &[u8], fence: bool) -> OutsideStatus;
}

/// An operation whose outside call may have been made and whose answer is
/// not recorded yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InFlight {
    pub kind: CallKind,
    /// The call as it arrived (its authorization included): what the
    /// handler finishes with, whoever settles it.
    pub call: StepCall,
    /// [`OutsideSystem::name`] when it was recorded.
    pub system: String,
    /// What was (or is about to be) sent, sent again as is.
    pub request: Vec<u8>,
    /// Unix ms when it was recorded.
    pub since_ms: u64,
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(b);
}

fn take_bytes(b: &mut &[u8]) -> Result<Vec<u8>, String> {
    let n = u32::from_be_bytes(take(b, 4)?.try_into().expect("4 bytes")) as usize;
    Ok(take(b, n)?.to_vec())
}

impl InFlight {
    /// `IN_FLIGHT_FORMAT, kind`, then `since_ms, saga_id, term,
    /// expires_at_ms` (8 bytes BE each), `step` (4 bytes BE), then the
    /// strings operation id, action, fingerprint, precondition, forward
    /// operation id, principal, tenant, policy and system, and the byte
    /// strings input and request, each as a 4-byte BE length and its
    /// bytes; then, when the call carries earlier steps' outputs, their
    /// count (4 bytes BE) and each one's step (4 bytes BE), name and
    /// output (records written before outputs existed end before it).
    pub fn encode(&self) -> Vec<u8> {
        let c = &self.call;
        let mut out = vec![
            IN_FLIGHT_FORMAT,
            match self.kind {
                CallKind::Forward => 1,
                CallKind::Compensate => 2,
            },
        ];
        for n in [self.since_ms, c.saga_id, c.term, c.authorization.expires_at_ms] {
            out.extend_from_slice(&n.to_be_bytes());
        }
        out.extend_from_slice(&c.step.to_be_bytes());
        for s in [
            &c.operation_id,
            &c.action,
            &c.fingerprint,
            &c.precondition,
            &c.forward_operation_id,
            &c.authorization.principal,
            &c.authorization.tenant,
            &c.authorization.policy,
            &self.system,
        ] {
            put_str(&mut out, s);
        }
        put_bytes(&mut out, &c.input);
        put_bytes(&mut out, &self.request);
        if !c.outputs.is_empty() {
            out.extend_from_slice(&(c.outputs.len() as u32).to_be_bytes());
            for o in &c.outputs {
                out.extend_from_slice(&o.step.to_be_bytes());
                put_str(&mut out, &o.name);
                put_bytes(&mut out, &o.output);
            }
        }
        out
    }

    pub fn decode(mut b: &[u8]) -> Result<InFlight, String> {
        let b = &mut b;
        let head = take(b, 2)?;
        if head[0] != IN_FLIGHT_FORMAT {
            return Err(format!("not an in-flight record (format {})", head[0]));
        }
        let kind = match head[1] {
            1 => CallKind::Forward,
            2 => CallKind::Compensate,
            k => return Err(format!("unknown call kind {k}")),
        };
        let since_ms = take_u64(b)?;
        let saga_id = take_u64(b)?;
        let term = take_u64(b)?;
        let expires_at_ms = take_u64(b)?;
        let step = u32::from_be_bytes(take(b, 4)?.try_into().expect("4 bytes"));
        let operation_id = take_str(b)?;
        let action = take_str(b)?;
        let fingerprint = take_str(b)?;
        let precondition = take_str(b)?;
        let forward_operation_id = take_str(b)?;
        let principal = take_str(b)?;
        let tenant = take_str(b)?;
        let policy = take_str(b)?;
        let system = take_str(b)?;
        let input = take_bytes(b)?;
        let request = take_bytes(b)?;
        let mut outputs = Vec::new();
        if !b.is_empty() {
            let n = u32::from_be_bytes(take(b, 4)?.try_into().expect("4 bytes"));
            for _ in 0..n {
                let step = u32::from_be_bytes(take(b, 4)?.try_into().expect("4 bytes"));
                let name = take_str(b)?;
                let output = take_bytes(b)?;
                outputs.push(StepOutput { step, name, output });
            }
        }
        if !b.is_empty() {
            return Err(format!("{} bytes after the record", b.len()));
        }
        Ok(InFlight {
            kind,
            call: StepCall {
                saga_id,
                step,
                operation_id,
                action,
                input,
                fingerprint,
                precondition,
                forward_operation_id,
                authorization: Authorization {
                    principal,
                    tenant,
                    expires_at_ms,
                    policy,
                },
                term,
                outputs,
            },
            system,
            request,
            since_ms,
        })
    }
}

/// What the inbox holds under an operation id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InboxEntry {
    /// The call's recorded answer.
    Answered(StepRecord),
    /// Its outside call may have been made; no answer recorded yet.
    InFlight(InFlight),
}

impl InboxEntry {
    pub fn decode(b: &[u8]) -> Result<InboxEntry, String> {
        match b.first() {
            Some(&IN_FLIGHT_FORMAT) => InFlight::decode(b).map(InboxEntry::InFlight),
            _ => StepRecord::decode(b).map(InboxEntry::Answered),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        match self {
            InboxEntry::Answered(r) => r.encode(),
            InboxEntry::InFlight(f) => f.encode(),
        }
    }

    /// The action the operation ran (empty for a fence record).
    pub fn action(&self) -> &str {
        match self {
            InboxEntry::Answered(r) => &r.action,
            InboxEntry::InFlight(f) => &f.call.action,
        }
    }
}

/// The error text of an operation whose outside call is in flight and
/// whose outcome the outside system could not tell (`why`).
pub(crate) fn in_flight_message(op: &str, f: &InFlight, why: &str) -> String {
    format!(
        "operation {op:?} is in flight at the {} since unix ms {} (its outcome is UNKNOWN, not failed; the \
         status hook settles it): {why}",
        f.system, f.since_ms
    )
}

/// A repeated call of an in-flight operation: refused when it was the
/// other kind of call, or carries another fingerprint (as
/// [`check_repeat`](super::rules::check_repeat) refuses a repeat of an
/// answered one).
pub(crate) fn check_resend(kind: CallKind, call: &StepCall, f: &InFlight) -> Result<(), StepError> {
    let rec = StepRecord {
        kind: f.kind,
        result: StepResult::failed(""),
        at_ms: f.since_ms,
        saga_id: f.call.saga_id,
        step: f.call.step,
        action: f.call.action.clone(),
        fingerprint: f.call.fingerprint.clone(),
    };
    check_repeat_only(kind, call, &rec)
}

/// The record that fences in-flight operation `f` after its outside
/// system said it never happened (and now refuses its key).
pub(crate) fn fenced_in_flight(f: &InFlight) -> StepRecord {
    StepRecord {
        kind: f.kind,
        result: StepResult::failed(format!("{FENCED_OUTSIDE_REASON} ({})", f.system)),
        at_ms: unix_ms(),
        saga_id: f.call.saga_id,
        step: f.call.step,
        action: f.call.action.clone(),
        fingerprint: f.call.fingerprint.clone(),
    }
}

/// Counts an outside call or status question by what it found
/// (`dtx_step_outside_total{call, outcome}`).
pub(crate) fn count_outside(call: &'static str, outcome: &'static str) {
    metrics::counter!("dtx_step_outside_total", "call" => call, "outcome" => outcome).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_records_round_trip_beside_answered_ones() {
        let f = InFlight {
            kind: CallKind::Compensate,
            call: StepCall {
                saga_id: 7,
                step: 1,
                operation_id: "7.1.c0@00ab".into(),
                action: "refund".into(),
                input: vec![0, 1, 2, 255],
                fingerprint: "fp".into(),
                precondition: "v3".into(),
                forward_operation_id: "7.1.f0@00ab".into(),
                outputs: vec![StepOutput {
                    step: 0,
                    name: "reserve".into(),
                    output: b"r-7".to_vec(),
                }],
                authorization: Authorization {
                    principal: "shop".into(),
                    tenant: "t".into(),
                    expires_at_ms: 99,
                    policy: "p".into(),
                },
                term: 4,
            },
            system: "payment provider".into(),
            request: b"{\"amount\":5}".to_vec(),
            since_ms: 1234,
        };
        let b = f.encode();
        assert_eq!(InFlight::decode(&b), Ok(f.clone()));
        assert_eq!(InboxEntry::decode(&b), Ok(InboxEntry::InFlight(f.clone())));
        assert_eq!(InboxEntry::InFlight(f.clone()).action(), "refund");
        // The same record without outputs is the format before outputs
        // existed, and reads as such.
        let mut old = f.clone();
        old.call.outputs.clear();
        let ob = old.encode();
        assert!(b.starts_with(&ob));
        assert_eq!(InFlight::decode(&ob), Ok(old));
        // Cut anywhere else, or with bytes after it: refused, never misread.
        for n in (0..b.len()).filter(|n| *n != ob.len()) {
            assert!(InFlight::decode(&b[..n]).is_err(), "cut at {n}");
        }
        let mut longer = b.clone();
        longer.push(0);
        assert!(InFlight::decode(&longer).is_err());
        // An answered record still decodes as one.
        let rec = super::super::rules::fence_record(3, 2);
        assert_eq!(InboxEntry::decode(&rec.encode()), Ok(InboxEntry::Answered(rec)));
    }
}
