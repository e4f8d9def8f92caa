//! Participant SDK (issue 3, in progress).
//!
//! Done: `log`, the pure decision logic of the participant's durable local
//! log: what to do with each Prepare / Commit / Abort given what the log
//! already holds (idempotent Prepare, tombstone on Abort-before-Prepare,
//! exactly-once Commit/Abort, term fencing, protocol violations).
//!
//! To come (issue 3): the `Resource` trait a service implements, the sled
//! store that makes the resource change and the log record durable together,
//! the gRPC server of `dtx.v1.ParticipantService`, and recovery (asking the
//! cluster for the decisions of in-doubt transactions).

pub mod log;
