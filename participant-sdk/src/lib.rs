//! Participant SDK (not implemented yet: issue 3).
//!
//! It will hold the trait a service implements for its resource (prepare,
//! commit, abort), the gRPC server of `dtx.v1.ParticipantService`
//! (proto/dtx/v1/participant.proto), and the durable local log that makes
//! Prepare idempotent, leaves a tombstone on Abort-before-Prepare, applies
//! each decision exactly once and fences older leader terms. Nothing in this
//! crate is used yet.
