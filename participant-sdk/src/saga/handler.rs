//! What a step service implements on the sled store ([`StepHandler`]),
//! and what its calls read and write through: [`StepView`] (the business
//! data and the inbox) and [`StepStaged`] (writes and outbox events, kept
//! only with an OK answer).

use std::cell::RefCell;

use super::keys::data_key;
use super::keys::inbox_key;
use super::outside::InboxEntry;
use super::outside::OutsideSystem;
use super::types::CallKind;
use super::types::StepCall;
use super::types::StepError;
use super::types::StepRecord;
use super::types::StepResult;
use crate::outbox::store::DataRead;
use crate::outbox::store::DataWrite;
use crate::outbox::OutboxMessage;
use crate::participant::StoreError;
use crate::store::unix_ms;
use crate::store::KvPair;

/// Read access to the business data (the `d` key space). A read error is
/// remembered: the call it happened in then answers an error (UNKNOWN to
/// the orchestrator) and records nothing, whatever the handler returned.
pub struct StepView<'a> {
    tree: &'a sled::Tree,
    error: RefCell<Option<String>>,
}

impl<'a> StepView<'a> {
    pub(super) fn new(tree: &'a sled::Tree) -> Self {
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

    pub(super) fn take_error(&self) -> Option<String> {
        self.error.borrow_mut().take()
    }
}

/// What a handler stages in one call: business writes and outbox
/// messages. They become durable with the call's inbox record, in one
/// batch, and only when the call answers OK (or PENDING).
#[derive(Default, Debug)]
pub struct StepStaged {
    pub(super) ops: crate::store::StagedOps,
    pub(super) events: Vec<OutboxMessage>,
}

impl StepStaged {
    pub fn put(&mut self, key: &[u8], value: &[u8]) {
        self.ops.push((key.to_vec(), Some(value.to_vec())));
    }

    pub fn delete(&mut self, key: &[u8]) {
        self.ops.push((key.to_vec(), None));
    }

    /// Adds a message to the store's outbox (the general one,
    /// [`crate::outbox`]): written with the call's answer, published at
    /// least once by the store's relays ([`StepStore::relay`](super::StepStore::relay)),
    /// in order per aggregate.
    pub fn emit(&mut self, msg: OutboxMessage) {
        self.events.push(msg);
    }

    /// What was staged for `key` so far: `None` when nothing, `Some(None)`
    /// when deleted (a handler that writes a key twice reads its own write).
    pub fn staged(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        crate::store::latest_in(&self.ops, key)
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

impl DataRead for StepView<'_> {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        StepView::get(self, key)
    }

    fn scan(&self, prefix: &[u8]) -> Result<Vec<KvPair>, StoreError> {
        StepView::scan(self, prefix)
    }
}

impl DataWrite for StepStaged {
    fn put(&mut self, key: &[u8], value: &[u8]) {
        StepStaged::put(self, key, value)
    }

    fn delete(&mut self, key: &[u8]) {
        StepStaged::delete(self, key)
    }

    fn latest(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        self.staged(key)
    }

    fn count_set_with_prefix(&self, prefix: &[u8]) -> usize {
        crate::store::count_set_in(&self.ops, prefix)
    }

    fn extend(&mut self, other: Self) {
        self.ops.extend(other.ops);
        self.events.extend(other.events);
    }
}
