//! The step-service side of sagas (DESIGN "Sagas", issue 14, ADR 0019):
//! what a service embeds to run saga steps for the cluster's orchestrator
//! (`dtx.v1.SagaStepService`: Forward, Compensate, Status).
//!
//! A step service
//! 1. implements [`StepHandler`] for its business: `forward` runs a step's
//!    forward action, `compensate` undoes it (checking the resource's
//!    version with [`StepCall::check_precondition`]), `authorize` checks
//!    the saga's rights (by default: refused once they expired);
//! 2. opens a [`StepStore`] on a directory of its own (or a sled tree):
//!    the business data, the inbox of operation ids and the outbox of
//!    events live there together;
//! 3. serves [`StepServer`] with [`serve_steps`] (or
//!    [`serve_steps_guarded`]: TLS or node tokens, only the cluster's nodes
//!    may call), and runs [`spawn_outbox_relay`] when it emits events.
//!
//! # What the store guarantees
//!
//! - **Once per operation id.** Each call's reply is recorded in the INBOX
//!   under its operation id, in ONE atomic sled batch with the handler's
//!   business writes and outbox events, and that batch is fsynced BEFORE
//!   the reply is sent. A repeated operation id answers the recorded reply
//!   and never runs the handler again (counted in
//!   `dtx_step_duplicates_total` and durably, see [`StepStats`]).
//! - **Only an OK answer changes anything.** FAILED, NOOP and STALE answers
//!   are recorded (so a repeat answers the same) but the writes and events
//!   the handler staged for them are discarded. After a FAILED forward the
//!   orchestrator retries under a NEW operation id.
//! - **Compensation checks the forward action happened here**: when the
//!   inbox has no OK forward reply under `forward_operation_id`, the answer
//!   is NOOP ("the forward action never happened here"), recorded under the
//!   compensation's operation id, without running the handler.
//! - **Rights are checked on every new call** (`StepHandler::authorize`);
//!   a refusal answers FAILED naming it and is NOT recorded (the rights may
//!   be renewed and the same operation id sent again). A repeat of a
//!   recorded operation id answers its reply without the check.
//! - **Status** ([`StepStore::status`]) answers what an operation id did
//!   (nothing yet, or its recorded reply) after an fsync that covers it;
//!   it changes nothing and takes no lock, except that an operation whose
//!   outside call is in flight is settled by asking the outside system
//!   (its answer is then recorded).
//! - **A store that cannot write stops**, as the participant store does:
//!   its first failed write or fsync makes it refuse every later call
//!   (an error status, which the orchestrator takes as UNKNOWN and
//!   reconciles through Status once the service is back), and
//!   [`StepStore::stopped`] completes so the service can exit and be
//!   restarted.
//! - **The outbox** is delivered at least once by [`spawn_outbox_relay`]:
//!   an event is removed only after its sink accepted it.
//! - **A call outside the service** (a payment provider, a mail sender:
//!   [`StepHandler::outside_request`], [`OutsideSystem`], ADR 0034) is
//!   recorded IN FLIGHT, durably, before it is made, with the operation id
//!   as the outside system's idempotency key; its answer is recorded after
//!   it like any other. Without an answer the operation stays in flight
//!   (the call answers an error: UNKNOWN), and Status and Fence settle it
//!   only by asking the outside system ([`OutsideSystem::status`]): never
//!   FAILED, never fenced, while the outside system cannot say it did not
//!   happen. See the [`outside`] module.
//!
//! Concurrency: Forward and Compensate calls of one store run one at a
//! time (one tokio mutex per store, held from the inbox look-up to the
//! batch; the fsync runs outside it), so a handler needs no locking of its
//! own. Status takes no lock.
//!
//! Key layout in the tree: `d` + key -> the business data (what
//! [`StepView`] and [`StepStaged`] read and write); `n` + operation id ->
//! the inbox record; `o` + sequence number (big-endian u64) -> a pending
//! outbox event; `m` + name -> store metadata (the next event number, the
//! duplicate counters).

use std::cell::RefCell;
use std::path::Path;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use dtx_proto::v1 as pb;
use dtx_proto::v1::saga_step_service_server::SagaStepService;
use dtx_proto::v1::saga_step_service_server::SagaStepServiceServer;
use tonic::Request;
use tonic::Response;
use tonic::Status;
use tracing::debug;
use tracing::warn;

use crate::participant::StoreError;
use crate::participant::StoreFailure;
use crate::store::sled_disk_full;
use crate::store::unix_ms;
use crate::store::FailureLatch;
use crate::store::KvPair;
use crate::store::{open_dir_sync, open_sled};

pub mod outside;
use outside::check_resend;
use outside::count_outside;
use outside::in_flight_message;
pub use outside::InFlight;
pub use outside::InboxEntry;
pub use outside::OutsideStatus;
pub use outside::OutsideSystem;

const DATA_PREFIX: u8 = b'd';
const INBOX_PREFIX: u8 = b'n';
const OUTBOX_PREFIX: u8 = b'o';
/// The number the next outbox event gets (big-endian u64).
const OUTBOX_NEXT_KEY: &[u8] = b"moutbox-next";
/// Repeated operation ids seen by Forward and Compensate (big-endian u64).
const DUPLICATES_FORWARD_KEY: &[u8] = b"mduplicates-forward";
const DUPLICATES_COMPENSATE_KEY: &[u8] = b"mduplicates-compensate";
/// The sled tree a store opened on a directory uses.
pub const STEP_TREE: &str = "saga_steps";
const RECORD_FORMAT: u8 = 1;
/// Events one relay pass hands to the sink at most.
const RELAY_BATCH_MAX: usize = 100;

/// The rights a saga runs with (`dtx.v1.SagaAuthorization`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Authorization {
    pub principal: String,
    pub tenant: String,
    /// Unix ms after which these rights may no longer be used; 0: never.
    pub expires_at_ms: u64,
    pub policy: String,
}

impl Authorization {
    /// True when the rights have expired at `now_ms`.
    pub fn expired_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms != 0 && now_ms >= self.expires_at_ms
    }
}

impl From<pb::SagaAuthorization> for Authorization {
    fn from(a: pb::SagaAuthorization) -> Self {
        Authorization {
            principal: a.principal,
            tenant: a.tenant,
            expires_at_ms: a.expires_at_ms,
            policy: a.policy,
        }
    }
}

impl From<Authorization> for pb::SagaAuthorization {
    fn from(a: Authorization) -> Self {
        pb::SagaAuthorization {
            principal: a.principal,
            tenant: a.tenant,
            expires_at_ms: a.expires_at_ms,
            policy: a.policy,
        }
    }
}

/// One call of a step (`dtx.v1.StepCall`): a forward action or a
/// compensation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepCall {
    pub saga_id: u64,
    pub step: u32,
    /// The idempotency key (`"<saga_id>.<step>.f"` / `".c"` from the
    /// orchestrator; any non-empty string here).
    pub operation_id: String,
    /// The forward action's or the compensation's name.
    pub action: String,
    pub input: Vec<u8>,
    pub fingerprint: String,
    /// Compensation: the resource version the forward action reported;
    /// empty for forward calls and unversioned steps.
    pub precondition: String,
    /// Compensation: the forward call's operation id.
    pub forward_operation_id: String,
    pub authorization: Authorization,
    /// The orchestrating leader's Raft term (for logs).
    pub term: u64,
}

impl From<pb::StepCall> for StepCall {
    fn from(c: pb::StepCall) -> Self {
        StepCall {
            saga_id: c.saga_id,
            step: c.step,
            operation_id: c.operation_id,
            action: c.action,
            input: c.input,
            fingerprint: c.fingerprint,
            precondition: c.precondition,
            forward_operation_id: c.forward_operation_id,
            authorization: c.authorization.map(Into::into).unwrap_or_default(),
            term: c.term,
        }
    }
}

impl From<StepCall> for pb::StepCall {
    fn from(c: StepCall) -> Self {
        pb::StepCall {
            saga_id: c.saga_id,
            step: c.step,
            operation_id: c.operation_id,
            action: c.action,
            input: c.input,
            fingerprint: c.fingerprint,
            precondition: c.precondition,
            forward_operation_id: c.forward_operation_id,
            authorization: Some(c.authorization.into()),
            term: c.term,
        }
    }
}

impl StepCall {
    /// The precondition rule of a compensation: `Err(Stale)` when the call
    /// carries a precondition (the version the forward action left) and
    /// the resource's `current_version` is another one (it moved on since:
    /// someone else changed it, so undoing could destroy their change).
    /// An empty precondition (an unversioned step) always holds.
    ///
    /// ```
    /// # use participant_sdk::saga::{StepCall, StepResult};
    /// let call = StepCall { precondition: "7".into(), ..StepCall::default() };
    /// assert!(call.check_precondition("7").is_ok());
    /// assert!(matches!(call.check_precondition("8"), Err(StepResult::Stale { .. })));
    /// ```
    pub fn check_precondition(&self, current_version: &str) -> Result<(), StepResult> {
        if self.precondition.is_empty() || self.precondition == current_version {
            return Ok(());
        }
        Err(StepResult::Stale {
            reason: format!(
                "the resource's version is {current_version:?}, not {:?} as the forward action left it: it moved on, so it is not undone",
                self.precondition
            ),
            residual: String::new(),
        })
    }
}

/// What a forward action or a compensation answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepResult {
    /// Done. `resource_version`: the resource's version after it (versioned
    /// steps; the compensation's precondition). `downstream_operation_id`:
    /// the service's own id of the operation (the store fills in the
    /// operation id when empty). `residual`: for a compensation, what it
    /// could not undo (empty: everything).
    Ok {
        resource_version: String,
        downstream_operation_id: String,
        residual: String,
    },
    /// Not done, and nothing changed.
    Failed { reason: String },
    /// A compensation with nothing to undo.
    Noop { reason: String },
    /// A compensation refused: the resource's version moved on; nothing
    /// changed. `residual`: what therefore stays in place.
    Stale { reason: String, residual: String },
}

impl StepResult {
    /// OK with the resource's version (empty for unversioned steps).
    pub fn ok(resource_version: impl Into<String>) -> StepResult {
        StepResult::Ok {
            resource_version: resource_version.into(),
            downstream_operation_id: String::new(),
            residual: String::new(),
        }
    }

    pub fn failed(reason: impl Into<String>) -> StepResult {
        StepResult::Failed { reason: reason.into() }
    }

    pub fn noop(reason: impl Into<String>) -> StepResult {
        StepResult::Noop { reason: reason.into() }
    }

    pub fn is_ok(&self) -> bool {
        matches!(self, StepResult::Ok { .. })
    }

    pub fn outcome(&self) -> pb::StepOutcome {
        match self {
            StepResult::Ok { .. } => pb::StepOutcome::Ok,
            StepResult::Failed { .. } => pb::StepOutcome::Failed,
            StepResult::Noop { .. } => pb::StepOutcome::Noop,
            StepResult::Stale { .. } => pb::StepOutcome::Stale,
        }
    }

    /// The outcome's name, for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            StepResult::Ok { .. } => "ok",
            StepResult::Failed { .. } => "failed",
            StepResult::Noop { .. } => "noop",
            StepResult::Stale { .. } => "stale",
        }
    }

    pub fn to_reply(&self) -> pb::StepReply {
        let mut r = pb::StepReply {
            outcome: self.outcome() as i32,
            ..Default::default()
        };
        match self {
            StepResult::Ok {
                resource_version,
                downstream_operation_id,
                residual,
            } => {
                r.resource_version = resource_version.clone();
                r.downstream_operation_id = downstream_operation_id.clone();
                r.residual = residual.clone();
            }
            StepResult::Failed { reason } | StepResult::Noop { reason } => r.reason = reason.clone(),
            StepResult::Stale { reason, residual } => {
                r.reason = reason.clone();
                r.residual = residual.clone();
            }
        }
        r
    }

    /// The result a reply carries; `None` for an outcome a step service
    /// never answers (UNSPECIFIED, UNKNOWN, SKIPPED).
    pub fn from_reply(r: &pb::StepReply) -> Option<StepResult> {
        Some(match pb::StepOutcome::try_from(r.outcome).ok()? {
            pb::StepOutcome::Ok => StepResult::Ok {
                resource_version: r.resource_version.clone(),
                downstream_operation_id: r.downstream_operation_id.clone(),
                residual: r.residual.clone(),
            },
            pb::StepOutcome::Failed => StepResult::failed(r.reason.clone()),
            pb::StepOutcome::Noop => StepResult::noop(r.reason.clone()),
            pb::StepOutcome::Stale => StepResult::Stale {
                reason: r.reason.clone(),
                residual: r.residual.clone(),
            },
            _ => return None,
        })
    }
}

/// Which call an inbox record answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    Forward,
    Compensate,
}

impl CallKind {
    pub fn as_str(self) -> &'static str {
        match self {
            CallKind::Forward => "forward",
            CallKind::Compensate => "compensate",
        }
    }
}

/// An inbox record: what one operation id answered here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepRecord {
    pub kind: CallKind,
    pub result: StepResult,
    /// Unix ms when it was recorded.
    pub at_ms: u64,
    pub saga_id: u64,
    pub step: u32,
    pub action: String,
    pub fingerprint: String,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn take<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8], String> {
    if b.len() < n {
        return Err(format!("truncated: {} bytes left, {n} needed", b.len()));
    }
    let (head, rest) = b.split_at(n);
    *b = rest;
    Ok(head)
}

fn take_u64(b: &mut &[u8]) -> Result<u64, String> {
    Ok(u64::from_be_bytes(take(b, 8)?.try_into().expect("8 bytes")))
}

fn take_str(b: &mut &[u8]) -> Result<String, String> {
    let n = u32::from_be_bytes(take(b, 4)?.try_into().expect("4 bytes")) as usize;
    String::from_utf8(take(b, n)?.to_vec()).map_err(|e| e.to_string())
}

impl StepRecord {
    /// `format, kind, outcome, at_ms, saga_id (8 bytes BE each), step (4
    /// bytes BE)`, then the strings reason, resource version, downstream
    /// operation id, residual, action and fingerprint, each as a 4-byte BE
    /// length and its UTF-8 bytes.
    pub fn encode(&self) -> Vec<u8> {
        let (outcome, reason, version, downstream, residual): (u8, &str, &str, &str, &str) = match &self.result {
            StepResult::Ok {
                resource_version,
                downstream_operation_id,
                residual,
            } => (1, "", resource_version, downstream_operation_id, residual),
            StepResult::Failed { reason } => (2, reason, "", "", ""),
            StepResult::Noop { reason } => (3, reason, "", "", ""),
            StepResult::Stale { reason, residual } => (4, reason, "", "", residual),
        };
        let mut out = vec![
            RECORD_FORMAT,
            match self.kind {
                CallKind::Forward => 1,
                CallKind::Compensate => 2,
            },
            outcome,
        ];
        out.extend_from_slice(&self.at_ms.to_be_bytes());
        out.extend_from_slice(&self.saga_id.to_be_bytes());
        out.extend_from_slice(&self.step.to_be_bytes());
        for s in [reason, version, downstream, residual, &self.action, &self.fingerprint] {
            put_str(&mut out, s);
        }
        out
    }

    pub fn decode(mut b: &[u8]) -> Result<StepRecord, String> {
        let b = &mut b;
        let head = take(b, 3)?;
        if head[0] != RECORD_FORMAT {
            return Err(format!("unknown record format {}", head[0]));
        }
        let kind = match head[1] {
            1 => CallKind::Forward,
            2 => CallKind::Compensate,
            k => return Err(format!("unknown call kind {k}")),
        };
        let at_ms = take_u64(b)?;
        let saga_id = take_u64(b)?;
        let step = u32::from_be_bytes(take(b, 4)?.try_into().expect("4 bytes"));
        let reason = take_str(b)?;
        let resource_version = take_str(b)?;
        let downstream_operation_id = take_str(b)?;
        let residual = take_str(b)?;
        let action = take_str(b)?;
        let fingerprint = take_str(b)?;
        let result = match head[2] {
            1 => StepResult::Ok {
                resource_version,
                downstream_operation_id,
                residual,
            },
            2 => StepResult::Failed { reason },
            3 => StepResult::Noop { reason },
            4 => StepResult::Stale { reason, residual },
            o => return Err(format!("unknown outcome {o}")),
        };
        Ok(StepRecord {
            kind,
            result,
            at_ms,
            saga_id,
            step,
            action,
            fingerprint,
        })
    }
}

fn data_key(key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.push(DATA_PREFIX);
    k.extend_from_slice(key);
    k
}

fn inbox_key(operation_id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(operation_id.len() + 1);
    k.push(INBOX_PREFIX);
    k.extend_from_slice(operation_id.as_bytes());
    k
}

fn outbox_key(seq: u64) -> [u8; 9] {
    let mut k = [OUTBOX_PREFIX; 9];
    k[1..].copy_from_slice(&seq.to_be_bytes());
    k
}

fn read_u64(v: Option<sled::IVec>) -> u64 {
    v.and_then(|v| <[u8; 8]>::try_from(&v[..]).ok())
        .map(u64::from_be_bytes)
        .unwrap_or(0)
}

/// Read access to the business data (the `d` key space). A read error is
/// remembered: the call it happened in then answers an error (UNKNOWN to
/// the orchestrator) and records nothing, whatever the handler returned.
pub struct StepView<'a> {
    tree: &'a sled::Tree,
    error: RefCell<Option<String>>,
}

impl<'a> StepView<'a> {
    fn new(tree: &'a sled::Tree) -> Self {
        StepView {
            tree,
            error: RefCell::new(None),
        }
    }

    fn io(&self, e: sled::Error) -> StoreError {
        let msg = e.to_string();
        self.error.borrow_mut().get_or_insert(msg.clone());
        StoreError::Io(msg)
    }

    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.tree
            .get(data_key(key))
            .map(|v| v.map(|v| v.to_vec()))
            .map_err(|e| self.io(e))
    }

    /// Every (key, value) whose key starts with `prefix`, in key order.
    pub fn scan(&self, prefix: &[u8]) -> Result<Vec<KvPair>, StoreError> {
        self.tree
            .scan_prefix(data_key(prefix))
            .map(|r| r.map(|(k, v)| (k[1..].to_vec(), v.to_vec())))
            .collect::<Result<_, _>>()
            .map_err(|e| self.io(e))
    }

    /// What operation id `operation_id` answered here, if anything (an
    /// operation in flight has answered nothing yet: `None`).
    pub fn record(&self, operation_id: &str) -> Result<Option<StepRecord>, StoreError> {
        Ok(match self.entry(operation_id)? {
            Some(InboxEntry::Answered(rec)) => Some(rec),
            _ => None,
        })
    }

    /// What the inbox holds under `operation_id`: its answer, or its
    /// in-flight outside call.
    pub fn entry(&self, operation_id: &str) -> Result<Option<InboxEntry>, StoreError> {
        match self.tree.get(inbox_key(operation_id)).map_err(|e| self.io(e))? {
            None => Ok(None),
            Some(b) => InboxEntry::decode(&b).map(Some).map_err(|m| {
                let msg = format!("inbox record of operation {operation_id:?} is damaged: {m}");
                self.error.borrow_mut().get_or_insert(msg.clone());
                StoreError::Io(msg)
            }),
        }
    }

    fn take_error(&self) -> Option<String> {
        self.error.borrow_mut().take()
    }
}

/// What a handler stages in one call: business writes and outbox events.
/// They become durable with the call's inbox record, in one batch, and only
/// when the call answers OK.
#[derive(Default, Debug)]
pub struct StepStaged {
    ops: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    events: Vec<Vec<u8>>,
}

impl StepStaged {
    pub fn put(&mut self, key: &[u8], value: &[u8]) {
        self.ops.push((key.to_vec(), Some(value.to_vec())));
    }

    pub fn delete(&mut self, key: &[u8]) {
        self.ops.push((key.to_vec(), None));
    }

    /// Adds an event to the outbox (delivered at least once, in order, by
    /// [`spawn_outbox_relay`]).
    pub fn emit(&mut self, event: impl Into<Vec<u8>>) {
        self.events.push(event.into());
    }

    /// What was staged for `key` so far: `None` when nothing, `Some(None)`
    /// when deleted (a handler that writes a key twice reads its own write).
    pub fn staged(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        self.ops.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_deref())
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty() && self.events.is_empty()
    }
}

/// The rights check every handler gets by default: refused once
/// `authorization.expires_at_ms` (when not 0) is past at `now_ms`.
pub fn authorization_current(call: &StepCall, now_ms: u64) -> Result<(), String> {
    if call.authorization.expired_at(now_ms) {
        return Err(format!(
            "the saga's rights (principal {:?}) expired at {} ms, now is {now_ms} ms",
            call.authorization.principal, call.authorization.expires_at_ms
        ));
    }
    Ok(())
}

/// What a step service implements. Calls run one at a time (see the module
/// documentation) and must not block on the network: they read through the
/// view and stage their writes and events. A step that calls a system
/// outside the service declares the call ([`StepHandler::outside_request`])
/// and the store makes it, outside the lock.
pub trait StepHandler: Send + Sync + 'static {
    /// Runs the forward action `call.action` (dispatch on it; an unknown
    /// name should answer FAILED). Only an OK answer keeps what it staged.
    fn forward(&self, view: &StepView<'_>, call: &StepCall, staged: &mut StepStaged) -> StepResult;

    /// Undoes the forward action `call.forward_operation_id` (which the
    /// store has checked answered OK here) with compensation `call.action`.
    /// Before changing anything it compares the resource's current version
    /// with `call.precondition` ([`StepCall::check_precondition`]) and
    /// answers STALE when it moved on. Only an OK answer keeps what it
    /// staged.
    fn compensate(&self, view: &StepView<'_>, call: &StepCall, staged: &mut StepStaged) -> StepResult;

    /// Whether the call's rights allow it (checked before every new call,
    /// forward and compensation); `Err(why)` answers FAILED with `why`.
    /// Default: refused once the rights expired.
    fn authorize(&self, call: &StepCall) -> Result<(), String> {
        authorization_current(call, unix_ms())
    }

    /// Whether `query` names a status query of this service (a Status call
    /// with another is refused INVALID_ARGUMENT). Default: any.
    fn knows_query(&self, _query: &str) -> bool {
        true
    }

    /// Whether status query `query` answers for operations of `action` (a
    /// forward action or a compensation): a Status or Fence naming another
    /// action's query is refused INVALID_ARGUMENT and settles nothing.
    /// Default: [`StepHandler::knows_query`].
    fn query_answers(&self, query: &str, _action: &str) -> bool {
        self.knows_query(query)
    }

    /// The system outside this service that its outside calls go to
    /// ([`StepHandler::outside_request`]) and whose status hook settles
    /// them. Default: none.
    fn outside(&self) -> Option<&dyn OutsideSystem> {
        None
    }

    /// Whether call `call` (`kind`: a forward action, or a compensation
    /// whose forward action answered OK here) calls the outside system,
    /// and with what request (ADR 0034):
    /// - `Ok(None)`: it does not; `forward` or `compensate` runs as usual;
    /// - `Ok(Some(request))`: the store records the call IN FLIGHT, durably,
    ///   then sends `request` with [`OutsideSystem::call`] under the
    ///   operation id as idempotency key (holding no lock), then runs
    ///   [`StepHandler::finish_outside`] with the answer;
    /// - `Err(result)`: answered at once, without calling (an unknown
    ///   customer: FAILED), and recorded like any answer.
    ///
    /// Reads only; nothing is staged here. Default: `Ok(None)`.
    fn outside_request(
        &self,
        _view: &StepView<'_>,
        _kind: CallKind,
        _call: &StepCall,
    ) -> Result<Option<Vec<u8>>, StepResult> {
        Ok(None)
    }

    /// The outside system answered `answer` to the request of in-flight
    /// call `call` (straight away, or later through the status hook,
    /// maybe after a restart): the step's result, staging the local writes
    /// and events it implies (kept only for an OK). Must accept every
    /// answer the outside system can give, a refusal of a fenced key
    /// included (FAILED). Default: FAILED.
    fn finish_outside(
        &self,
        _view: &StepView<'_>,
        kind: CallKind,
        call: &StepCall,
        _answer: &[u8],
        _staged: &mut StepStaged,
    ) -> StepResult {
        StepResult::failed(format!(
            "{} {:?} got an outside answer, but this service finishes no outside calls",
            kind.as_str(),
            call.action
        ))
    }
}

/// Why a call got no reply.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// The store could not read, write or sync (or stopped): whether the
    /// call was applied is not known to the caller (UNKNOWN); Status tells
    /// once the store answers again.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The call is malformed (empty operation id; an operation id recorded
    /// for the other kind of call); nothing was done.
    #[error("{0}")]
    Invalid(String),
    /// The operation id is recorded here for another request: a repeat
    /// whose fingerprint differs from the recorded one (the same id reused
    /// for other work: another saga's, another cluster's, or a cluster's
    /// from before a restore). Refused, nothing done, never answered with
    /// the other request's reply (FAILED_PRECONDITION).
    #[error("{0}")]
    Conflict(String),
    /// The operation's outside call is in flight and its outcome is not
    /// known here: the outside system gave no answer, or its status hook
    /// could not tell (ADR 0034). UNKNOWN to the orchestrator, never
    /// FAILED; nothing is fenced (UNAVAILABLE).
    #[error("{0}")]
    InFlight(String),
}

/// What the store's inbox and outbox hold ([`StepStore::stats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Inbox records (operation ids answered), by kind.
    pub forward_records: u64,
    pub compensate_records: u64,
    /// Repeated operation ids answered from the inbox since the store was
    /// created (durable with the next fsync).
    pub forward_duplicates: u64,
    pub compensate_duplicates: u64,
    /// Outbox events not yet delivered.
    pub outbox_pending: u64,
    /// Operations whose outside call is in flight (no answer recorded).
    pub in_flight: u64,
}

/// What `StepStore::apply` did with a call.
enum Applied {
    /// The operation id was answered before: its record.
    Repeat(StepRecord),
    /// Refused before anything ran (rights); not recorded.
    Refused(StepResult),
    /// Answered and recorded now (not synced yet).
    Recorded(StepResult),
    /// Recorded in flight now (not synced yet): its outside call is next.
    Outside(InFlight),
    /// In flight before: its outside call is sent again (same key, same
    /// request).
    Resend(InFlight),
}

/// The step service's durable store; see the module documentation.
pub struct StepStore<H: StepHandler> {
    /// Kept open as long as the store when it opened a directory.
    _db: Option<sled::Db>,
    /// What sled's flush leaves out: the fsync of the directory's files.
    sync: Arc<dtx_durable::DirSync>,
    tree: sled::Tree,
    handler: H,
    /// Serializes Forward and Compensate, from the inbox look-up to the
    /// batch (never held across the fsync).
    serial: tokio::sync::Mutex<()>,
    /// The number of the next outbox event (written under `serial`).
    next_event: Mutex<u64>,
    /// Set by the first failed write; then every call is refused.
    latch: FailureLatch,
}

impl<H: StepHandler> StepStore<H> {
    /// Opens (or creates) a store in directory `path` (sled tree
    /// [`STEP_TREE`]), waiting a moment for a directory lock still held by
    /// a store of this process that is closing.
    pub fn open(path: &Path, handler: H) -> Result<Arc<Self>, StoreError> {
        let open_err = |e: sled::Error| StoreError::Open {
            path: path.display().to_string(),
            disk_full: sled_disk_full(&e),
            message: e.to_string(),
        };
        let db = open_sled(path).map_err(open_err)?;
        let tree = db.open_tree(STEP_TREE).map_err(open_err)?;
        let sync = open_dir_sync(path)?;
        Self::build(Some(db), tree, sync, path.display().to_string(), handler)
    }

    /// A store on `tree` of the database the caller opened in directory
    /// `dir` and keeps open, beside whatever else the database holds.
    /// Every fsync covers the whole database.
    pub fn open_tree(dir: &Path, tree: sled::Tree, handler: H) -> Result<Arc<Self>, StoreError> {
        let name = String::from_utf8_lossy(&tree.name()).into_owned();
        let sync = open_dir_sync(dir)?;
        Self::build(None, tree, sync, format!("sled tree {name:?}"), handler)
    }

    fn build(
        db: Option<sled::Db>,
        tree: sled::Tree,
        sync: dtx_durable::DirSync,
        path: String,
        handler: H,
    ) -> Result<Arc<Self>, StoreError> {
        let io = |e: sled::Error| StoreError::Io(e.to_string());
        // The next event number: past the stored counter and past every
        // pending event (whichever is larger).
        let stored = read_u64(tree.get(OUTBOX_NEXT_KEY).map_err(io)?);
        let last = match tree.scan_prefix([OUTBOX_PREFIX]).next_back() {
            Some(r) => {
                let (k, _) = r.map_err(io)?;
                <[u8; 8]>::try_from(&k[1..]).map(u64::from_be_bytes).unwrap_or(0) + 1
            }
            None => 0,
        };
        Ok(Arc::new(StepStore {
            _db: db,
            tree,
            sync: Arc::new(sync),
            latch: FailureLatch::new(path),
            handler,
            serial: tokio::sync::Mutex::new(()),
            next_event: Mutex::new(stored.max(last).max(1)),
        }))
    }

    pub fn handler(&self) -> &H {
        &self.handler
    }

    /// The business data as written so far (not necessarily synced).
    pub fn view(&self) -> StepView<'_> {
        StepView::new(&self.tree)
    }

    /// For tests and tools: the underlying tree.
    pub fn tree(&self) -> &sled::Tree {
        &self.tree
    }

    /// Runs a forward call once per operation id (see the module
    /// documentation). Answers only after the answer is durable.
    pub async fn forward(&self, call: &StepCall) -> Result<StepResult, StepError> {
        self.call(CallKind::Forward, call).await
    }

    /// Runs a compensation once per operation id: NOOP without running the
    /// handler when the forward operation did not answer OK here.
    pub async fn compensate(&self, call: &StepCall) -> Result<StepResult, StepError> {
        self.call(CallKind::Compensate, call).await
    }

    async fn call(&self, kind: CallKind, call: &StepCall) -> Result<StepResult, StepError> {
        let answer = self.call_inner(kind, call).await;
        count_call(kind.as_str(), &answer);
        answer
    }

    async fn call_inner(&self, kind: CallKind, call: &StepCall) -> Result<StepResult, StepError> {
        self.check_running()?;
        check_call(kind, call)?;
        if kind == CallKind::Compensate {
            // A compensation of a forward action whose outside call is in
            // flight: settled first, by the status hook with a fence (if it
            // did not happen, it never will), so the check below sees an
            // answer. An outside system that cannot tell leaves the
            // compensation UNKNOWN.
            if let Some(InboxEntry::InFlight(f)) = self.view().entry(&call.forward_operation_id)? {
                self.settle(&call.forward_operation_id, f, true).await?;
            }
        }
        let applied = {
            let _serial = self.serial.lock().await;
            self.check_running()?;
            self.apply(kind, call)?
        };
        let result = match applied {
            Applied::Repeat(rec) => return self.repeat(kind, call, rec).await,
            Applied::Refused(result) => return Ok(result),
            Applied::Recorded(result) => result,
            // The in-flight record is durable before anything leaves (for a
            // resend too: the record may be another call's, not synced yet).
            Applied::Outside(f) | Applied::Resend(f) => {
                self.flush().await?;
                return self.call_outside(kind, f).await;
            }
        };
        self.flush().await?;
        match kind {
            CallKind::Forward => dtx_failpoint::failpoint!("step_forward_after_commit_before_reply"),
            CallKind::Compensate => dtx_failpoint::failpoint!("step_compensation_after_commit_before_reply"),
        }
        debug!(
            saga_id = call.saga_id,
            step = call.step,
            operation_id = %call.operation_id,
            action = %call.action,
            outcome = result.label(),
            "{} recorded",
            kind.as_str()
        );
        Ok(result)
    }

    /// The synchronous part of a call, under the store's lock: the inbox
    /// look-up, the rights check, the handler, and the one batch (not
    /// synced: the caller flushes). A call that goes outside is recorded
    /// in flight here instead.
    fn apply(&self, kind: CallKind, call: &StepCall) -> Result<Applied, StepError> {
        let view = self.view();
        match view.entry(&call.operation_id)? {
            Some(InboxEntry::Answered(rec)) => return Ok(Applied::Repeat(rec)),
            Some(InboxEntry::InFlight(f)) => {
                check_resend(kind, call, &f)?;
                return Ok(Applied::Resend(f));
            }
            None => {}
        }
        if let Err(why) = self.handler.authorize(call) {
            debug!(
                saga_id = call.saga_id,
                step = call.step,
                operation_id = %call.operation_id,
                "{} refused: {why}",
                kind.as_str()
            );
            return Ok(Applied::Refused(StepResult::failed(format!(
                "authorization refused: {why}"
            ))));
        }
        let mut staged = StepStaged::default();
        let mut fence: Option<String> = None;
        let result = match kind {
            CallKind::Forward => match self.outside_plan(&view, kind, call)? {
                Ok(Some(request)) => return self.start_outside(kind, call, request),
                Ok(None) => self.handler.forward(&view, call, &mut staged),
                Err(answer) => answer,
            },
            CallKind::Compensate => match view.entry(&call.forward_operation_id)? {
                Some(InboxEntry::Answered(f)) if f.kind == CallKind::Forward && f.result.is_ok() => {
                    match self.outside_plan(&view, kind, call)? {
                        Ok(Some(request)) => return self.start_outside(kind, call, request),
                        Ok(None) => self.handler.compensate(&view, call, &mut staged),
                        Err(answer) => answer,
                    }
                }
                Some(InboxEntry::Answered(f)) => noop_for(&call.forward_operation_id, Some(&f)),
                Some(InboxEntry::InFlight(f)) => {
                    // Settled before the lock was taken, in flight again:
                    // never NOOP (nor fence) what may have happened.
                    return Err(StepError::InFlight(in_flight_message(
                        &call.forward_operation_id,
                        &f,
                        "the compensation of it waits until it is settled",
                    )));
                }
                None => {
                    // Fence the forward operation in the same batch: a late
                    // forward call of it must never run after this NOOP.
                    fence = Some(call.forward_operation_id.clone());
                    noop_for(&call.forward_operation_id, None)
                }
            },
        };
        if let Some(e) = view.take_error() {
            // The handler read through an error: its answer may rest on
            // nothing; record nothing and let the orchestrator ask again.
            return Err(StoreError::Io(format!("a read failed during the call: {e}")).into());
        }
        let record = record_of(kind, call, result);
        let result = record.result.clone();
        if !result.is_ok() {
            // Only an OK answer changes anything.
            staged = StepStaged::default();
        }
        let mut batch = sled::Batch::default();
        let next_event = self.stage_batch(&mut batch, staged);
        batch.insert(inbox_key(&call.operation_id), record.encode());
        if let Some(f) = fence {
            batch.insert(inbox_key(&f), fence_record(call.saga_id, call.step).encode());
        }
        self.tree.apply_batch(batch).map_err(|e| self.fail(&e))?;
        *self.next_event.lock().expect("next_event lock") = next_event;
        Ok(Applied::Recorded(result))
    }

    /// The handler's [`StepHandler::outside_request`] for a call, after a
    /// read error check.
    fn outside_plan(
        &self,
        view: &StepView<'_>,
        kind: CallKind,
        call: &StepCall,
    ) -> Result<Result<Option<Vec<u8>>, StepResult>, StepError> {
        let plan = self.handler.outside_request(view, kind, call);
        if let Some(e) = view.take_error() {
            return Err(StoreError::Io(format!("a read failed during the call: {e}")).into());
        }
        if matches!(plan, Ok(Some(_))) && self.handler.outside().is_none() {
            return Err(StepError::Invalid(format!(
                "{} {:?} asks for an outside call, but the handler names no outside system",
                kind.as_str(),
                call.action
            )));
        }
        Ok(plan)
    }

    /// Records `call` in flight (not synced: the caller flushes before the
    /// outside call).
    fn start_outside(&self, kind: CallKind, call: &StepCall, request: Vec<u8>) -> Result<Applied, StepError> {
        let f = InFlight {
            kind,
            call: call.clone(),
            system: self.handler.outside().map(|s| s.name().to_string()).unwrap_or_default(),
            request,
            since_ms: unix_ms(),
        };
        self.tree
            .insert(inbox_key(&call.operation_id), f.encode())
            .map_err(|e| self.fail(&e))?;
        Ok(Applied::Outside(f))
    }

    /// Sends in-flight call `f` to the outside system (no lock held) and
    /// records its answer; no answer leaves it in flight (an error:
    /// UNKNOWN to the orchestrator).
    async fn call_outside(&self, kind: CallKind, f: InFlight) -> Result<StepResult, StepError> {
        let op = f.call.operation_id.clone();
        let Some(system) = self.handler.outside() else {
            return Err(StepError::InFlight(in_flight_message(
                &op,
                &f,
                "this service names no outside system to send it to",
            )));
        };
        match system.call(&op, &f.request).await {
            Ok(answer) => {
                count_outside("call", "answered");
                let rec = self.finish(&op, &answer).await?;
                match kind {
                    CallKind::Forward => dtx_failpoint::failpoint!("step_forward_after_commit_before_reply"),
                    CallKind::Compensate => {
                        dtx_failpoint::failpoint!("step_compensation_after_commit_before_reply")
                    }
                }
                debug!(operation_id = %op, outcome = rec.result.label(), "outside call answered and recorded");
                Ok(rec.result)
            }
            Err(why) => {
                count_outside("call", "no_answer");
                let msg = in_flight_message(&op, &f, &format!("no answer from the {}: {why}", system.name()));
                tracing::info!("{msg}");
                Err(StepError::InFlight(msg))
            }
        }
    }

    /// Records the outside system's `answer` to in-flight operation `op`
    /// (the handler's result and its staged writes, in one batch), unless
    /// something settled it first; its record, once durable.
    async fn finish(&self, op: &str, answer: &[u8]) -> Result<StepRecord, StepError> {
        let rec = {
            let _serial = self.serial.lock().await;
            self.check_running()?;
            let view = self.view();
            match view.entry(op)? {
                Some(InboxEntry::Answered(rec)) => rec,
                None => {
                    return Err(StoreError::Io(format!("operation {op:?} was in flight and has no record now")).into())
                }
                Some(InboxEntry::InFlight(f)) => {
                    let mut staged = StepStaged::default();
                    let result = self.handler.finish_outside(&view, f.kind, &f.call, answer, &mut staged);
                    if let Some(e) = view.take_error() {
                        return Err(StoreError::Io(format!("a read failed while finishing {op:?}: {e}")).into());
                    }
                    let record = record_of(f.kind, &f.call, result);
                    if !record.result.is_ok() {
                        staged = StepStaged::default();
                    }
                    let mut batch = sled::Batch::default();
                    let next_event = self.stage_batch(&mut batch, staged);
                    batch.insert(inbox_key(op), record.encode());
                    self.tree.apply_batch(batch).map_err(|e| self.fail(&e))?;
                    *self.next_event.lock().expect("next_event lock") = next_event;
                    record
                }
            }
        };
        self.flush().await?;
        Ok(rec)
    }

    /// Settles in-flight operation `op` by the outside system's status hook
    /// (with `fence`: "not done" made final there, and recorded FAILED
    /// here): its record, `None` when not done, an error while the outside
    /// system cannot tell.
    async fn settle(&self, op: &str, f: InFlight, fence: bool) -> Result<Option<StepRecord>, StepError> {
        let Some(system) = self.handler.outside() else {
            return Err(StepError::InFlight(in_flight_message(
                op,
                &f,
                "this service names no outside system whose status hook could settle it",
            )));
        };
        match system.status(op, &f.request, fence).await {
            OutsideStatus::Done(answer) => {
                count_outside("status", "done");
                self.finish(op, &answer).await.map(Some)
            }
            OutsideStatus::NotDone if !fence => {
                count_outside("status", "not_done");
                Ok(None)
            }
            OutsideStatus::NotDone => {
                count_outside("fence", "not_done");
                let existing = {
                    let _serial = self.serial.lock().await;
                    self.check_running()?;
                    match self.view().entry(op)? {
                        Some(InboxEntry::Answered(rec)) => Some(rec),
                        _ => {
                            self.tree
                                .insert(inbox_key(op), fenced_in_flight(&f).encode())
                                .map_err(|e| self.fail(&e))?;
                            None
                        }
                    }
                };
                self.flush().await?;
                Ok(existing)
            }
            OutsideStatus::Unknown(why) => {
                count_outside(if fence { "fence" } else { "status" }, "unknown");
                Err(StepError::InFlight(in_flight_message(
                    op,
                    &f,
                    &format!("the {}'s status hook cannot tell: {why}", system.name()),
                )))
            }
        }
    }

    /// Adds `staged` (business writes, and outbox events under the next
    /// numbers) to `batch`; returns the number the event after them gets.
    fn stage_batch(&self, batch: &mut sled::Batch, staged: StepStaged) -> u64 {
        for (k, v) in staged.ops {
            match v {
                Some(v) => batch.insert(data_key(&k), v),
                None => batch.remove(data_key(&k)),
            }
        }
        let mut next_event = *self.next_event.lock().expect("next_event lock");
        if !staged.events.is_empty() {
            for ev in staged.events {
                batch.insert(&outbox_key(next_event)[..], ev);
                next_event += 1;
            }
            batch.insert(OUTBOX_NEXT_KEY, &next_event.to_be_bytes()[..]);
        }
        next_event
    }

    /// A repeated operation id: its recorded reply, once that is durable.
    async fn repeat(&self, kind: CallKind, call: &StepCall, rec: StepRecord) -> Result<StepResult, StepError> {
        check_repeat(kind, call, &rec)?;
        let key = match kind {
            CallKind::Forward => DUPLICATES_FORWARD_KEY,
            CallKind::Compensate => DUPLICATES_COMPENSATE_KEY,
        };
        self.tree
            .update_and_fetch(key, |v| {
                Some((read_u64(v.map(sled::IVec::from)) + 1).to_be_bytes().to_vec())
            })
            .map_err(|e| self.fail(&e))?;
        // The record may have been written by a call whose fsync is still
        // running (or failed): answer only once it is on disk.
        self.flush().await?;
        debug!(
            operation_id = %call.operation_id,
            outcome = rec.result.label(),
            "repeated {} answered from the inbox",
            kind.as_str()
        );
        Ok(rec.result)
    }

    /// What `operation_id` did here: `None` when nothing (yet), else its
    /// record. Answered after an fsync that covers it. An operation whose
    /// outside call is in flight is settled by the outside system's status
    /// hook: done → its answer is recorded and answered; not done → `None`
    /// (it stays in flight); cannot tell → [`StepError::InFlight`].
    pub async fn status(&self, operation_id: &str) -> Result<Option<StepRecord>, StepError> {
        self.status_of(operation_id, None).await
    }

    /// [`StepStore::status`] for status query `query` (when given, refused
    /// unless it answers for the operation's action,
    /// [`StepHandler::query_answers`]).
    pub async fn status_of(&self, operation_id: &str, query: Option<&str>) -> Result<Option<StepRecord>, StepError> {
        let answer = self.lookup(operation_id, query, false).await;
        count_lookup("status", &answer);
        answer
    }

    /// What `operation_id` did here, like [`StepStore::status`]; when
    /// nothing, records it as a FAILED forward call ("fenced") and answers
    /// `None`: a late call of it then answers FAILED and never runs, so the
    /// answer "not applied" stays true. Answered after the fsync. An
    /// operation in flight is asked of the outside system's status hook
    /// with a fence: done → recorded and answered; not done (and refused
    /// there from now on) → recorded FAILED (fenced), `None`; cannot tell
    /// → [`StepError::InFlight`], nothing recorded: never fenced while it
    /// may have happened.
    pub async fn fence(&self, operation_id: &str) -> Result<Option<StepRecord>, StepError> {
        self.fence_of(operation_id, None).await
    }

    /// [`StepStore::fence`] for status query `query` (see
    /// [`StepStore::status_of`]).
    pub async fn fence_of(&self, operation_id: &str, query: Option<&str>) -> Result<Option<StepRecord>, StepError> {
        let answer = self.lookup(operation_id, query, true).await;
        count_fence(&answer);
        answer
    }

    async fn lookup(&self, op: &str, query: Option<&str>, fence: bool) -> Result<Option<StepRecord>, StepError> {
        self.check_running()?;
        if op.is_empty() {
            return Err(StepError::Invalid(format!(
                "the {} names no operation id",
                if fence { "fence" } else { "status query" }
            )));
        }
        let entry = self.view().entry(op)?;
        if let (Some(q), Some(e)) = (query, &entry) {
            check_query(|q, a| self.handler.query_answers(q, a), op, q, e)?;
        }
        let entry = match entry {
            None if fence => {
                let _serial = self.serial.lock().await;
                self.check_running()?;
                match self.view().entry(op)? {
                    None => {
                        self.tree
                            .insert(inbox_key(op), fence_record(0, 0).encode())
                            .map_err(|e| self.fail(&e))?;
                        None
                    }
                    // Recorded (or sent out) since the first look.
                    other => other,
                }
            }
            other => other,
        };
        match entry {
            None => {
                if fence {
                    self.flush().await?;
                }
                Ok(None)
            }
            Some(InboxEntry::Answered(rec)) => {
                // The record may have been written by a call whose fsync is
                // still running (or failed): answer only once it is on disk.
                self.flush().await?;
                Ok(Some(rec))
            }
            Some(InboxEntry::InFlight(f)) => self.settle(op, f, fence).await,
        }
    }

    /// What `operation_id` did here, as written so far (not synced; for
    /// tools and tests).
    pub fn record(&self, operation_id: &str) -> Result<Option<StepRecord>, StoreError> {
        self.view().record(operation_id)
    }

    /// Every answered inbox record (operation id, record), in operation id
    /// order (operations in flight: [`StepStore::in_flight`]).
    pub fn records(&self) -> Result<Vec<(String, StepRecord)>, StoreError> {
        Ok(self
            .entries()?
            .into_iter()
            .filter_map(|(op, e)| match e {
                InboxEntry::Answered(rec) => Some((op, rec)),
                InboxEntry::InFlight(_) => None,
            })
            .collect())
    }

    /// Every operation whose outside call is in flight, in operation id
    /// order.
    pub fn in_flight(&self) -> Result<Vec<(String, InFlight)>, StoreError> {
        Ok(self
            .entries()?
            .into_iter()
            .filter_map(|(op, e)| match e {
                InboxEntry::InFlight(f) => Some((op, f)),
                InboxEntry::Answered(_) => None,
            })
            .collect())
    }

    /// Everything the inbox holds, in operation id order.
    pub fn entries(&self) -> Result<Vec<(String, InboxEntry)>, StoreError> {
        let mut out = Vec::new();
        for r in self.tree.scan_prefix([INBOX_PREFIX]) {
            let (k, v) = r.map_err(|e| StoreError::Io(e.to_string()))?;
            let op = String::from_utf8_lossy(&k[1..]).into_owned();
            let e = InboxEntry::decode(&v)
                .map_err(|m| StoreError::Io(format!("inbox record of operation {op:?} is damaged: {m}")))?;
            out.push((op, e));
        }
        Ok(out)
    }

    /// Counts of the inbox, the duplicates seen and the outbox.
    pub fn stats(&self) -> Result<StepStats, StoreError> {
        let io = |e: sled::Error| StoreError::Io(e.to_string());
        let mut s = StepStats {
            forward_duplicates: read_u64(self.tree.get(DUPLICATES_FORWARD_KEY).map_err(io)?),
            compensate_duplicates: read_u64(self.tree.get(DUPLICATES_COMPENSATE_KEY).map_err(io)?),
            ..StepStats::default()
        };
        for (_, e) in self.entries()? {
            match e {
                InboxEntry::InFlight(_) => s.in_flight += 1,
                InboxEntry::Answered(rec) => match rec.kind {
                    CallKind::Forward => s.forward_records += 1,
                    CallKind::Compensate => s.compensate_records += 1,
                },
            }
        }
        s.outbox_pending = self.tree.scan_prefix([OUTBOX_PREFIX]).keys().count() as u64;
        Ok(s)
    }

    /// Up to `max` outbox events not yet delivered, oldest first (number,
    /// event), as written so far (the relay flushes before delivering).
    pub fn pending_events(&self, max: usize) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        self.tree
            .scan_prefix([OUTBOX_PREFIX])
            .take(max)
            .map(|r| {
                let (k, v) = r.map_err(|e| StoreError::Io(e.to_string()))?;
                let seq = <[u8; 8]>::try_from(&k[1..])
                    .map(u64::from_be_bytes)
                    .map_err(|_| StoreError::Io(format!("outbox key of {} bytes", k.len())))?;
                Ok((seq, v.to_vec()))
            })
            .collect()
    }

    /// Removes delivered events from the outbox, durably.
    pub async fn ack_events(&self, seqs: &[u64]) -> Result<(), StoreError> {
        self.check_running()?;
        let mut batch = sled::Batch::default();
        for &s in seqs {
            batch.remove(&outbox_key(s)[..]);
        }
        self.tree.apply_batch(batch).map_err(|e| self.fail(&e))?;
        self.flush().await
    }

    /// Writes business data outside any call (for example a new service's
    /// initial stock), atomically and durably; events it emits go to the
    /// outbox too.
    pub async fn write_data(&self, f: impl FnOnce(&StepView<'_>, &mut StepStaged)) -> Result<(), StoreError> {
        self.check_running()?;
        {
            let _serial = self.serial.lock().await;
            let view = self.view();
            let mut staged = StepStaged::default();
            f(&view, &mut staged);
            if let Some(e) = view.take_error() {
                return Err(StoreError::Io(e));
            }
            let mut batch = sled::Batch::default();
            let next_event = self.stage_batch(&mut batch, staged);
            self.tree.apply_batch(batch).map_err(|e| self.fail(&e))?;
            *self.next_event.lock().expect("next_event lock") = next_event;
        }
        self.flush().await
    }

    /// Waits for an fsync that covers every write made before the call. A
    /// failed fsync stops the store.
    pub async fn flush(&self) -> Result<(), StoreError> {
        self.check_running()?;
        let (tree, sync) = (self.tree.clone(), self.sync.clone());
        let res = tokio::task::spawn_blocking(move || sync.flush(&tree))
            .await
            .map_err(|e| StoreError::Io(format!("the fsync task failed: {e}")))?;
        res.map_err(|e| self.fail(&e))
    }

    /// Records the first failed write (the store stops, see
    /// `FailureLatch`), logs it once, and returns the error to give the
    /// caller.
    fn fail(&self, e: &sled::Error) -> StoreError {
        let (failure, first) = self.latch.record_sled(e);
        if first {
            tracing::error!(disk_full = failure.disk_full, "saga step store: {failure}");
        }
        StoreError::Stopped(failure)
    }

    fn check_running(&self) -> Result<(), StoreError> {
        self.latch.check()
    }

    /// Why the store stopped, if it has (a write or fsync failed).
    pub fn failure(&self) -> Option<StoreFailure> {
        self.latch.get()
    }

    /// Waits until the store stops (a write or fsync failed) and says why;
    /// the service should then exit and be restarted.
    pub async fn stopped(&self) -> StoreFailure {
        self.latch.stopped().await
    }
}

/// Where the outbox relay delivers events (a mail server, a queue, a
/// webhook). `Ok` means the sink has them: they are removed from the
/// outbox. A sink may see an event again (after an error, or a crash
/// between its `Ok` and the removal), so it should de-duplicate by the
/// event's number when that matters.
#[tonic::async_trait]
pub trait OutboxSink: Send + Sync {
    /// Delivers `events` (number, event), oldest first.
    async fn deliver(&self, events: &[(u64, Vec<u8>)]) -> Result<(), String>;
}

/// What the outbox relay needs of a step store: the sled [`StepStore`],
/// and the PostgreSQL one (`saga_pg::PgStepStore`, feature `postgres`).
#[tonic::async_trait]
pub trait Outbox: Send + Sync {
    /// Up to `max` events not delivered yet, oldest first (number, event).
    async fn pending(&self, max: usize) -> Result<Vec<(u64, Vec<u8>)>, StoreError>;
    /// Makes the events `pending` returned durable before they leave (the
    /// sled store fsyncs; what PostgreSQL returns is committed already).
    async fn make_durable(&self) -> Result<(), StoreError>;
    /// Removes delivered events, durably.
    async fn remove(&self, seqs: &[u64]) -> Result<(), StoreError>;
    /// Why the store stopped, if it has (the relay then ends).
    fn stopped_by(&self) -> Option<StoreFailure>;
}

#[tonic::async_trait]
impl<H: StepHandler> Outbox for StepStore<H> {
    async fn pending(&self, max: usize) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        self.pending_events(max)
    }

    async fn make_durable(&self) -> Result<(), StoreError> {
        self.flush().await
    }

    async fn remove(&self, seqs: &[u64]) -> Result<(), StoreError> {
        self.ack_events(seqs).await
    }

    fn stopped_by(&self) -> Option<StoreFailure> {
        self.failure()
    }
}

/// One relay pass: makes the events durable (only durable events leave
/// the service), hands up to 100 pending events to `sink`, and removes
/// them once it said OK. Returns how many were delivered.
pub async fn relay_once<O: Outbox + ?Sized>(store: &O, sink: &dyn OutboxSink) -> Result<usize, String> {
    let events = store.pending(RELAY_BATCH_MAX).await.map_err(|e| e.to_string())?;
    if events.is_empty() {
        return Ok(0);
    }
    store.make_durable().await.map_err(|e| e.to_string())?;
    sink.deliver(&events).await?;
    let seqs: Vec<u64> = events.iter().map(|(s, _)| *s).collect();
    store.remove(&seqs).await.map_err(|e| e.to_string())?;
    Ok(seqs.len())
}

/// Delivers the outbox to `sink` at least once: every `interval` (at once
/// again while events remain), one pass of [`relay_once`]; a sink error is
/// logged and the same events are tried again after `interval`. Ends when
/// the store stops or the handle is aborted.
pub fn spawn_outbox_relay<O: Outbox + 'static>(
    store: Arc<O>,
    sink: Arc<dyn OutboxSink>,
    interval: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            if let Some(f) = store.stopped_by() {
                tracing::error!("outbox relay stopped: {f}");
                return;
            }
            match relay_once(store.as_ref(), sink.as_ref()).await {
                Ok(n) if n >= RELAY_BATCH_MAX => continue,
                Ok(n) => {
                    if n > 0 {
                        debug!(delivered = n, "outbox events delivered");
                    }
                }
                Err(e) => warn!("outbox delivery failed; retrying in {interval:?}: {e}"),
            }
            tokio::time::sleep(interval).await;
        }
    })
}

/// What [`StepServer`] serves: a step store (the sled [`StepStore`], or
/// the PostgreSQL `saga_pg::PgStepStore` with the `postgres` feature).
#[tonic::async_trait]
pub trait StepBackend: Send + Sync + 'static {
    /// A forward call, once per operation id.
    async fn forward(&self, call: &StepCall) -> Result<StepResult, StepError>;
    /// A compensation, once per operation id (NOOP when the forward action
    /// did not happen here).
    async fn compensate(&self, call: &StepCall) -> Result<StepResult, StepError>;
    /// What an operation id did here (None: nothing yet), for status query
    /// `query` (refused when it does not answer for the operation's
    /// action); an operation in flight is settled by the outside system's
    /// status hook (ADR 0034).
    async fn status(&self, operation_id: &str, query: &str) -> Result<Option<StepRecord>, StepError>;
    /// As `status`, making "nothing" permanent (fenced); an operation in
    /// flight is fenced only when the outside system says it did not
    /// happen and never will.
    async fn fence(&self, operation_id: &str, query: &str) -> Result<Option<StepRecord>, StepError>;
    /// Whether `query` names a status query of this service.
    fn knows_query(&self, query: &str) -> bool;
}

#[tonic::async_trait]
impl<H: StepHandler> StepBackend for StepStore<H> {
    async fn forward(&self, call: &StepCall) -> Result<StepResult, StepError> {
        StepStore::forward(self, call).await
    }

    async fn compensate(&self, call: &StepCall) -> Result<StepResult, StepError> {
        StepStore::compensate(self, call).await
    }

    async fn status(&self, operation_id: &str, query: &str) -> Result<Option<StepRecord>, StepError> {
        StepStore::status_of(self, operation_id, Some(query)).await
    }

    async fn fence(&self, operation_id: &str, query: &str) -> Result<Option<StepRecord>, StepError> {
        StepStore::fence_of(self, operation_id, Some(query)).await
    }

    fn knows_query(&self, query: &str) -> bool {
        self.handler.knows_query(query)
    }
}

/// `dtx.v1.SagaStepService` on a step store ([`StepBackend`]).
pub struct StepServer<B: StepBackend> {
    store: Arc<B>,
}

impl<B: StepBackend> StepServer<B> {
    pub fn new(store: Arc<B>) -> Self {
        StepServer { store }
    }

    pub fn store(&self) -> &Arc<B> {
        &self.store
    }
}

/// The gRPC status of a call that got no reply: never an OK reply, so the
/// orchestrator takes the outcome as UNKNOWN (a stopped store or an I/O
/// error: UNAVAILABLE, asked again later; a malformed call:
/// INVALID_ARGUMENT or FAILED_PRECONDITION).
pub fn step_error_status(e: StepError) -> Status {
    match e {
        StepError::Invalid(m) if m.contains(" call here, not a ") => Status::failed_precondition(m),
        StepError::Invalid(m) => Status::invalid_argument(m),
        StepError::Conflict(m) => Status::failed_precondition(m),
        StepError::InFlight(m) => Status::unavailable(m),
        StepError::Store(StoreError::Stopped(f)) => Status::unavailable(f.to_string()),
        StepError::Store(StoreError::Io(m) | StoreError::Unavailable(m)) => Status::unavailable(m),
        StepError::Store(other) => Status::internal(other.to_string()),
    }
}

#[tonic::async_trait]
impl<B: StepBackend> SagaStepService for StepServer<B> {
    async fn forward(&self, req: Request<pb::StepCall>) -> Result<Response<pb::StepReply>, Status> {
        let call = StepCall::from(req.into_inner());
        let r = self.store.forward(&call).await.map_err(step_error_status)?;
        Ok(Response::new(r.to_reply()))
    }

    async fn compensate(&self, req: Request<pb::StepCall>) -> Result<Response<pb::StepReply>, Status> {
        let call = StepCall::from(req.into_inner());
        let r = self.store.compensate(&call).await.map_err(step_error_status)?;
        Ok(Response::new(r.to_reply()))
    }

    async fn fence(&self, req: Request<pb::StepStatusRequest>) -> Result<Response<pb::StepStatusReply>, Status> {
        let r = self.known_query(req)?;
        let rec = self
            .store
            .fence(&r.operation_id, &r.query)
            .await
            .map_err(step_error_status)?;
        Ok(Response::new(status_reply(rec)))
    }

    async fn status(&self, req: Request<pb::StepStatusRequest>) -> Result<Response<pb::StepStatusReply>, Status> {
        let r = self.known_query(req)?;
        let rec = self
            .store
            .status(&r.operation_id, &r.query)
            .await
            .map_err(step_error_status)?;
        Ok(Response::new(status_reply(rec)))
    }
}

impl<B: StepBackend> StepServer<B> {
    /// A Status or Fence request naming a status query this service has;
    /// INVALID_ARGUMENT otherwise.
    fn known_query(&self, req: Request<pb::StepStatusRequest>) -> Result<pb::StepStatusRequest, Status> {
        let r = req.into_inner();
        if !self.store.knows_query(&r.query) {
            return Err(Status::invalid_argument(format!(
                "this service has no status query {:?}",
                r.query
            )));
        }
        Ok(r)
    }
}

/// What Status and Fence answer for an operation's record (none: not
/// applied).
fn status_reply(rec: Option<StepRecord>) -> pb::StepStatusReply {
    pb::StepStatusReply {
        applied: rec.is_some(),
        reply: rec.map(|rec| rec.result.to_reply()),
    }
}

/// Counts a Forward or Compensate call (`dtx_step_calls_total`) by its
/// answer.
pub(crate) fn count_call(call: &'static str, answer: &Result<StepResult, StepError>) {
    let outcome = match answer {
        Ok(r) => r.label(),
        Err(StepError::Invalid(_)) => "invalid",
        Err(StepError::Conflict(_)) => "conflict",
        Err(StepError::InFlight(_)) => "in_flight",
        Err(StepError::Store(_)) => "error",
    };
    metrics::counter!("dtx_step_calls_total", "call" => call, "outcome" => outcome).increment(1);
}

/// Counts a Fence call (`dtx_step_calls_total`) by its answer.
pub(crate) fn count_fence(answer: &Result<Option<StepRecord>, StepError>) {
    let outcome = match answer {
        Ok(Some(_)) => "applied",
        Ok(None) => "fenced",
        Err(StepError::Invalid(_)) => "invalid",
        Err(StepError::Conflict(_)) => "conflict",
        Err(StepError::InFlight(_)) => "in_flight",
        Err(StepError::Store(_)) => "error",
    };
    metrics::counter!("dtx_step_calls_total", "call" => "fence", "outcome" => outcome).increment(1);
}

/// Refuses a Status or Fence whose status query does not answer for the
/// action of the operation's `entry` ([`StepHandler::query_answers`]; a
/// fence record names no action and any query answers for it).
pub(crate) fn check_query(
    answers: impl Fn(&str, &str) -> bool,
    op: &str,
    query: &str,
    entry: &InboxEntry,
) -> Result<(), StepError> {
    let action = entry.action();
    if action.is_empty() || answers(query, action) {
        return Ok(());
    }
    Err(StepError::Invalid(format!(
        "status query {query:?} does not answer for {action:?}, the action of operation {op:?}"
    )))
}

/// Counts a Status call (`dtx_step_calls_total`) by its answer.
pub(crate) fn count_lookup(call: &'static str, answer: &Result<Option<StepRecord>, StepError>) {
    let outcome = match answer {
        Ok(Some(_)) => "applied",
        Ok(None) => "not_applied",
        Err(StepError::Invalid(_)) => "invalid",
        Err(StepError::Conflict(_)) => "conflict",
        Err(StepError::InFlight(_)) => "in_flight",
        Err(StepError::Store(_)) => "error",
    };
    metrics::counter!("dtx_step_calls_total", "call" => call, "outcome" => outcome).increment(1);
}

/// Refuses a malformed call: no operation id, or a compensation naming no
/// forward operation id.
pub(crate) fn check_call(kind: CallKind, call: &StepCall) -> Result<(), StepError> {
    if call.operation_id.is_empty() {
        return Err(StepError::Invalid("the call has no operation id".into()));
    }
    if kind == CallKind::Compensate && call.forward_operation_id.is_empty() {
        return Err(StepError::Invalid(
            "the compensation names no forward operation id".into(),
        ));
    }
    Ok(())
}

/// A call whose operation id has record `rec` here: refused when it was
/// the other kind of call, and when both carry a fingerprint and they
/// differ (`StepError::Conflict`: the id names other work; answering the
/// recorded reply would report another request's outcome as this one's).
/// Counts the duplicate.
pub(crate) fn check_repeat(kind: CallKind, call: &StepCall, rec: &StepRecord) -> Result<(), StepError> {
    check_repeat_only(kind, call, rec)?;
    metrics::counter!("dtx_step_duplicates_total", "call" => kind.as_str()).increment(1);
    Ok(())
}

/// [`check_repeat`] without counting the duplicate.
pub(crate) fn check_repeat_only(kind: CallKind, call: &StepCall, rec: &StepRecord) -> Result<(), StepError> {
    if rec.kind != kind {
        return Err(StepError::Invalid(format!(
            "operation id {:?} was a {} call here, not a {} call",
            call.operation_id,
            rec.kind.as_str(),
            kind.as_str()
        )));
    }
    if !call.fingerprint.is_empty() && !rec.fingerprint.is_empty() && call.fingerprint != rec.fingerprint {
        warn!(
            operation_id = %call.operation_id,
            "refused: a repeated operation id carries another fingerprint ({} recorded, {} now)",
            rec.fingerprint,
            call.fingerprint
        );
        metrics::counter!("dtx_step_fingerprint_conflicts_total", "call" => kind.as_str()).increment(1);
        return Err(StepError::Conflict(format!(
            "operation id {:?} is recorded here for another request (fingerprint {} recorded, {} in this call); \
             refused, nothing done",
            call.operation_id, rec.fingerprint, call.fingerprint
        )));
    }
    Ok(())
}

/// The inbox record of `call` answered `result` now; an OK without a
/// downstream operation id gets the call's operation id.
pub(crate) fn record_of(kind: CallKind, call: &StepCall, result: StepResult) -> StepRecord {
    let result = match result {
        StepResult::Ok {
            resource_version,
            downstream_operation_id,
            residual,
        } => StepResult::Ok {
            resource_version,
            downstream_operation_id: if downstream_operation_id.is_empty() {
                call.operation_id.clone()
            } else {
                downstream_operation_id
            },
            residual,
        },
        other => other,
    };
    StepRecord {
        kind,
        result,
        at_ms: unix_ms(),
        saga_id: call.saga_id,
        step: call.step,
        action: call.action.clone(),
        fingerprint: call.fingerprint.clone(),
    }
}

/// The NOOP a compensation answers when its forward operation did not
/// answer OK here: `forward` is that operation's record (a FAILED, fenced
/// or other answer), or `None` when it has none (and is now fenced).
pub(crate) fn noop_for(forward_operation_id: &str, forward: Option<&StepRecord>) -> StepResult {
    let what = match forward {
        None => "is not in the inbox (now fenced)".to_string(),
        Some(f) if f.kind == CallKind::Compensate => "is a compensation".to_string(),
        Some(f) => match &f.result {
            StepResult::Failed { reason } | StepResult::Noop { reason } | StepResult::Stale { reason, .. } => {
                format!("answered {}: {reason}", f.result.label())
            }
            StepResult::Ok { .. } => "answered ok".to_string(),
        },
    };
    StepResult::noop(format!(
        "the forward action never happened here: operation {forward_operation_id:?} {what}"
    ))
}

/// The record that fences a forward operation id that never ran here.
pub(crate) fn fence_record(saga_id: u64, step: u32) -> StepRecord {
    StepRecord {
        kind: CallKind::Forward,
        result: StepResult::failed(FENCED_REASON),
        at_ms: unix_ms(),
        saga_id,
        step,
        action: String::new(),
        fingerprint: String::new(),
    }
}

/// The reason a fenced operation answers FAILED with.
pub const FENCED_REASON: &str =
    "fenced: the orchestrator found this operation not applied and settled it as never to run";

/// The reason an in-flight operation fenced by its outside system answers
/// FAILED with.
pub const FENCED_OUTSIDE_REASON: &str = "fenced: the outside system never did this operation and now refuses its \
     idempotency key; settled as never to run";

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

/// Who may call a step service served with TLS or node tokens: the
/// cluster's nodes (the orchestrator); Status, which changes nothing, also
/// operators. A method missing here is refused for everyone.
pub fn step_policy(path: &str) -> dtx_proto::tls::Access {
    use dtx_proto::tls::Access;
    use dtx_proto::tls::Role;
    match path.strip_prefix("/dtx.v1.SagaStepService/") {
        Some("Status") => Access::Roles(&[Role::Node, Role::Operator]),
        Some("Forward" | "Compensate" | "Fence") => Access::Roles(&[Role::Node]),
        _ => Access::Roles(&[]),
    }
}

/// Serves `service` (a [`StepServer`], or a wrapper of one) on `listener`
/// in plain text until `shutdown` completes. A service whose store can stop
/// by itself makes [`StepStore::stopped`] part of `shutdown`.
pub async fn serve_steps<S: SagaStepService>(
    service: S,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    serve_steps_guarded(service, listener, crate::server::Guard::default(), shutdown).await
}

/// As [`serve_steps`], over TLS when `tls` is set (mutual TLS: only the
/// cluster's nodes may call, see [`step_policy`]).
pub async fn serve_steps_with_tls<S: SagaStepService>(
    service: S,
    listener: tokio::net::TcpListener,
    tls: Option<Arc<dtx_proto::tls::ServerTls>>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let guard = crate::server::Guard {
        tls,
        node_tokens: dtx_proto::tls::Tokens::default(),
    };
    serve_steps_guarded(service, listener, guard, shutdown).await
}

/// As [`serve_steps`], with a [`crate::server::Guard`]: TLS, node tokens,
/// or both; then callers are checked against [`step_policy`] (refusals
/// counted in `dtx_auth_refusals_total{server="step"}`) before the service
/// sees the call. With neither, anyone may call.
pub async fn serve_steps_guarded<S: SagaStepService>(
    service: S,
    listener: tokio::net::TcpListener,
    guard: crate::server::Guard,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let crate::server::Guard { tls, node_tokens } = guard;
    let reloader = tls
        .as_ref()
        .map(|t| t.spawn_reloader(crate::server::TLS_RELOAD_INTERVAL, "saga step service"));
    let policy: dtx_proto::tls::AuthPolicy = if tls.is_some() || !node_tokens.is_empty() {
        step_policy
    } else {
        |_| dtx_proto::tls::Access::Open
    };
    let served = tonic::transport::Server::builder()
        .layer(
            dtx_proto::tls::EdgeLayer::new("step", node_tokens, policy)
                .marking_not_applied(dtx_proto::metadata::NOT_APPLIED_HEADER),
        )
        .add_service(SagaStepServiceServer::new(service))
        .serve_with_incoming_shutdown(dtx_proto::tls::incoming(listener, tls), shutdown)
        .await;
    if let Some(r) = reloader {
        r.abort();
    }
    served
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        for result in [
            StepResult::Ok {
                resource_version: "3".into(),
                downstream_operation_id: "inv-9".into(),
                residual: "r".into(),
            },
            StepResult::failed("out of stock"),
            StepResult::noop("never happened"),
            StepResult::Stale {
                reason: "moved".into(),
                residual: "kept".into(),
            },
        ] {
            let rec = StepRecord {
                kind: CallKind::Compensate,
                result: result.clone(),
                at_ms: 17,
                saga_id: 5,
                step: 2,
                action: "release".into(),
                fingerprint: "ab".into(),
            };
            assert_eq!(StepRecord::decode(&rec.encode()), Ok(rec));
            assert_eq!(StepResult::from_reply(&result.to_reply()), Some(result));
        }
        assert!(StepRecord::decode(&[9, 1, 1]).is_err());
        assert!(StepRecord::decode(&[RECORD_FORMAT, 1]).is_err());
    }

    #[test]
    fn policy_lets_nodes_call_and_refuses_unknown_methods() {
        use dtx_proto::tls::Access;
        use dtx_proto::tls::Role;
        assert_eq!(
            step_policy("/dtx.v1.SagaStepService/Forward"),
            Access::Roles(&[Role::Node])
        );
        assert_eq!(
            step_policy("/dtx.v1.SagaStepService/Compensate"),
            Access::Roles(&[Role::Node])
        );
        assert_eq!(step_policy("/dtx.v1.SagaStepService/Nope"), Access::Roles(&[]));
        assert_eq!(step_policy("/dtx.v1.ParticipantService/Prepare"), Access::Roles(&[]));
    }
}
