//! The step-service side of sagas (docs/sagas.md, ADR 0019):
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
//!    messages live there together;
//! 3. serves [`StepServer`] with [`serve_steps`] (or
//!    [`serve_steps_guarded`]: TLS or node tokens, only the cluster's nodes
//!    may call), and runs relays of its outbox ([`StepStore::relay`], with
//!    [`crate::outbox::spawn_relay`]) when it emits messages.
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
//! - **The outbox** is the SDK's general one ([`crate::outbox`], the same
//!   pieces every service uses): messages staged with
//!   [`StepStaged::emit`] are written with the call's answer (only an OK or
//!   PENDING one) and published at least once by the store's relays, in
//!   order per aggregate, dead-lettered after repeated failures.
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
//! [`StepView`] and [`StepStaged`] read and write, the outbox's keys
//! among them, under `crate::outbox::store::OUTBOX_KEY_PREFIX`); `n` +
//! operation id -> the inbox record; `m` + name -> store metadata (the
//! duplicate counters).
//!
//! Its parts, each using only those listed before it: `types` (calls,
//! answers, records), `codec` (their bytes), `rules` (what both step
//! stores refuse and record), [`outside`] (calls to outside systems),
//! `keys` (the tree's key layout), `handler` ([`StepHandler`], with
//! [`StepView`] and [`StepStaged`]), `service` (the
//! gRPC service and serving it) and `store` ([`StepStore`]).

mod codec;
mod handler;
mod keys;
pub mod outside;
mod rules;
mod service;
mod store;
mod types;

pub use handler::authorization_current;
pub use handler::StepHandler;
pub use handler::StepStaged;
pub use handler::StepView;
pub use keys::STEP_TREE;
pub use outside::InFlight;
pub use outside::InboxEntry;
pub use outside::OutsideStatus;
pub use outside::OutsideSystem;
pub use rules::FENCED_OUTSIDE_REASON;
pub use rules::FENCED_REASON;
pub use service::serve_steps;
pub use service::serve_steps_guarded;
pub use service::serve_steps_with_tls;
pub use service::step_error_status;
pub use service::step_policy;
pub use service::StepBackend;
pub use service::StepServer;
pub use store::StepStats;
pub use store::StepStore;
pub use types::Authorization;
pub use types::CallKind;
pub use types::StepCall;
pub use types::StepError;
pub use types::StepOutput;
pub use types::StepRecord;
pub use types::StepResult;

// For the PostgreSQL step store (`saga_pg`), which applies the same rules.
#[cfg(feature = "postgres")]
pub(crate) use handler::check_query;
#[cfg(feature = "postgres")]
pub(crate) use outside::fenced_in_flight;
#[cfg(feature = "postgres")]
pub(crate) use rules::{
    check_call, check_repeat, count_call, count_fence, count_lookup, fence_record, noop_for, record_of, vet,
};
