//! The sled step store ([`StepStore`]): each call run once per operation
//! id, its answer recorded in the inbox in one atomic, fsynced batch with
//! the handler's writes and outbox messages; outside calls recorded in
//! flight and settled. The outbox is the general one of the SDK's own
//! store ([`crate::outbox::store::StoreOutbox`], in the business data's
//! key space): relays with leases, order per aggregate, dead letters.

use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use tracing::debug;

use super::handler::check_query;
use super::handler::StepHandler;
use super::handler::StepStaged;
use super::handler::StepView;
use super::keys::data_key;
use super::keys::inbox_key;
use super::keys::read_u64;
use super::keys::DUPLICATES_COMPENSATE_KEY;
use super::keys::DUPLICATES_FORWARD_KEY;
use super::keys::INBOX_PREFIX;
use super::keys::STEP_TREE;
use super::outside::check_resend;
use super::outside::count_outside;
use super::outside::fenced_in_flight;
use super::outside::in_flight_message;
use super::outside::InFlight;
use super::outside::InboxEntry;
use super::outside::OutsideStatus;
use super::rules::check_call;
use super::rules::check_repeat;
use super::rules::count_call;
use super::rules::count_fence;
use super::rules::count_lookup;
use super::rules::fence_record;
use super::rules::noop_for;
use super::rules::record_of;
use super::service::StepBackend;
use super::types::CallKind;
use super::types::StepCall;
use super::types::StepError;
use super::types::StepRecord;
use super::types::StepResult;
use crate::outbox::store::DataStore;
use crate::outbox::store::StoreOutbox;
use crate::outbox::store::StoreRelay;
use crate::outbox::Publisher;
use crate::outbox::RelaySettings;
use crate::participant::StoreError;
use crate::participant::StoreFailure;
use crate::store::open_dir_sync;
use crate::store::open_sled;
use crate::store::sled_disk_full;
use crate::store::unix_ms;
use crate::store::FailureLatch;

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
    /// Outbox messages not published yet (pending; dead letters not
    /// counted).
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
    /// The outbox the handlers' messages go to (its relays share its
    /// leases).
    outbox: StoreOutbox,
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
        Ok(Arc::new(StepStore {
            _db: db,
            tree,
            sync: Arc::new(sync),
            latch: FailureLatch::new(path),
            handler,
            serial: tokio::sync::Mutex::new(()),
            outbox: StoreOutbox::new(),
        }))
    }

    /// The store's outbox (dead letters, requeue, the oldest message's age).
    pub fn outbox(&self) -> &StoreOutbox {
        &self.outbox
    }

    /// A relay named `owner` of the store's outbox, publishing to
    /// `publisher` (run it with [`crate::outbox::spawn_relay`]); the
    /// relays of one store share its leases, so each aggregate's messages
    /// go out one at a time, in order.
    pub fn relay<P: Publisher>(
        self: &Arc<Self>,
        owner: impl Into<String>,
        publisher: Arc<P>,
        settings: RelaySettings,
    ) -> StoreRelay<Self, P> {
        self.outbox.relay(self.clone(), owner, publisher, settings)
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
                Some(InboxEntry::Answered(f)) if f.kind == CallKind::Forward && f.result.happened() => {
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
        if !result.happened() {
            // Only an OK (or PENDING: accepted) answer changes anything.
            staged = StepStaged::default();
        }
        let mut batch = sled::Batch::default();
        self.stage_batch(&view, &mut batch, staged)?;
        batch.insert(inbox_key(&call.operation_id), record.encode());
        if let Some(f) = fence {
            batch.insert(inbox_key(&f), fence_record(call.saga_id, call.step).encode());
        }
        self.tree.apply_batch(batch).map_err(|e| self.fail(&e))?;
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
                    if !record.result.happened() {
                        staged = StepStaged::default();
                    }
                    let mut batch = sled::Batch::default();
                    self.stage_batch(&view, &mut batch, staged)?;
                    batch.insert(inbox_key(op), record.encode());
                    self.tree.apply_batch(batch).map_err(|e| self.fail(&e))?;
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

    /// Adds `staged` to `batch`: its business writes, and its outbox
    /// messages written into the outbox (their versions read through
    /// `view` and the writes before them).
    fn stage_batch(
        &self,
        view: &StepView<'_>,
        batch: &mut sled::Batch,
        mut staged: StepStaged,
    ) -> Result<(), StoreError> {
        for msg in std::mem::take(&mut staged.events) {
            self.outbox.write(view, &mut staged, &msg)?;
        }
        for (k, v) in staged.ops {
            match v {
                Some(v) => batch.insert(data_key(&k), v),
                None => batch.remove(data_key(&k)),
            }
        }
        Ok(())
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
        s.outbox_pending = self.outbox.pending_count(&self.view())? as u64;
        Ok(s)
    }

    /// Writes business data outside any call (for example a new service's
    /// initial stock), atomically and durably; messages it emits go to the
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
            self.stage_batch(&view, &mut batch, staged)?;
            if let Some(e) = view.take_error() {
                return Err(StoreError::Io(e));
            }
            self.tree.apply_batch(batch).map_err(|e| self.fail(&e))?;
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

/// The outbox's home: the store's business data.
impl<H: StepHandler> DataStore for StepStore<H> {
    type View<'a> = StepView<'a>;
    type Staged = StepStaged;

    fn data_view(&self) -> StepView<'_> {
        self.view()
    }

    fn write_data_with<'s>(
        &'s self,
        f: impl FnOnce(&StepView<'_>, &mut StepStaged) + Send + 's,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 's {
        self.write_data(f)
    }

    fn flush_data(&self) -> impl Future<Output = Result<(), StoreError>> + Send + '_ {
        self.flush()
    }
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
