//! The gRPC server of `dtx.v1.ParticipantService` on a
//! [`Participant`](crate::participant::Participant) (the sled
//! `ParticipantStore`, or the PostgreSQL participant), and recovery: asking
//! the cluster for the decisions of in-doubt transactions and applying them.
//!
//! Its parts, each using only those listed before it:
//! - `service`: [`ParticipantServer`], the gRPC service itself;
//! - `cluster`: [`RecoveryOptions`] and the questions to the cluster;
//! - `gc`: log garbage collection ([`collect_decided`], [`gc_safe`]);
//! - `recovery`: resolving in-doubt transactions ([`recover_once`],
//!   [`spawn_recovery_with`], the loop that also runs garbage collection);
//! - `serve`: the service and its recovery on a listener ([`serve`],
//!   [`serve_guarded`]), and who may call it ([`participant_policy`]).

mod cluster;
mod gc;
mod recovery;
mod serve;
mod service;

pub use cluster::RecoveryOptions;
pub use gc::collect_decided;
pub use gc::collect_decided_from;
pub use gc::gc_safe;
pub use gc::GcCursor;
pub use recovery::recover_older_than;
pub use recovery::recover_once;
pub use recovery::recover_with;
pub use recovery::spawn_recovery;
pub use recovery::spawn_recovery_with;
pub use serve::participant_policy;
pub use serve::serve;
pub use serve::serve_guarded;
pub use serve::serve_with_tls;
pub use serve::Guard;
pub use serve::TLS_RELOAD_INTERVAL;
pub use service::ParticipantServer;
