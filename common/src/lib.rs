//! What both sides of the wire share beyond the contract: the node
//! (`coordinator`) and the client (`dtx-client`, which re-exports these
//! modules under the same names) use them, and neither depends on the
//! other (docs/adr/0044-crate-lines.md).
//!
//! - [`trace`]: one W3C trace per transaction, a tokio task-local that
//!   servers continue and calls carry on.
//! - [`backoff`]: the one retry-delay formula (exponential, capped, with
//!   jitter).
//! - [`view`]: how operators read a transaction, in words shared by every
//!   tool that shows one.
//!
//! It depends on the wire contract (`dtx-proto`), tonic and tokio only: no
//! transport, no TLS, no Raft, no storage.

#![warn(missing_docs)]

pub mod backoff;
pub mod trace;
pub mod view;
