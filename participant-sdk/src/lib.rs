//! Participant SDK (issue 3, in progress).
//!
//! Done: `log`, the pure decision logic of the participant's durable local
//! log: what to do with each Prepare / Commit / Abort given what the log
//! already holds (idempotent Prepare, tombstone on Abort-before-Prepare,
//! exactly-once Commit/Abort, term fencing, protocol violations).
//!
//! Done: `store`, the durable participant store on sled: the `Resource`
//! trait a service implements, one atomic write for the resource change and
//! the log record, replies only after an fsync (shared by concurrent
//! requests), and the list of in-doubt transactions.
//!
//! Done: `server`, the gRPC server of `dtx.v1.ParticipantService` on the
//! store, and recovery: asking the cluster (linearizable, batched, any node)
//! for the decisions of in-doubt transactions, on start and periodically.
//!
//! Done: `enlist`, self-enlistment of a service that received a txid from
//! its caller (`dtx_proto::attach_txid` / `dtx_proto::txid_of` carry it in
//! gRPC metadata).
//!
//! To come: an external-resource variant (PostgreSQL prepared transactions)
//! that records intent before calling the resource.

pub mod enlist;
pub mod failpoint;
pub mod log;
pub mod server;
pub mod store;
