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
//! The in-doubt list is consistent under concurrent Commit/Abort; a log
//! entry that is really inconsistent is logged, counted
//! (`dtx_participant_log_inconsistencies_total`) and skipped, never taken
//! as "nothing in doubt".
//!
//! Done: log garbage collection (`server::collect_decided`, run by the
//! recovery loop past `RecoveryOptions::log_retention`): a decided record
//! or a READ_ONLY vote is removed only once the cluster will send nothing
//! more for it: decided with this participant's ack recorded
//! (`GetDecisions` with `RecoveryOptions::participant_id` answers
//! `awaiting_ack`), or forgotten. Until then a redelivered decision must
//! find the record, or a Commit would be refused as a commit without
//! prepare, forever.
//!
//! Done: a store that cannot write stops. sled 0.34.7 refuses every write
//! after a failed one (a full disk) until it is reopened, so at its first
//! failed write or fsync the store refuses every request (a full disk as
//! `StoreError::Stopped` with `is_disk_full()`, RESOURCE_EXHAUSTED "the
//! disk is full" over gRPC), acknowledges nothing more, and
//! `ParticipantStore::stopped()` tells the service to exit so that its
//! supervisor restarts it on what is on disk. A start on a full disk says
//! so, and never leaves the directory unopenable (sled's unfinished
//! snapshot files are removed).
//!
//! Done: `enlist`, self-enlistment of a service that received a txid from
//! its caller (`dtx_proto::attach_txid` / `dtx_proto::txid_of` carry it in
//! gRPC metadata).
//!
//! To come: an external-resource variant (PostgreSQL prepared transactions)
//! that records intent before calling the resource.

pub mod log;
pub mod server;
pub mod store;
