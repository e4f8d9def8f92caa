//! The wire contract of the dtx coordinator: what every process that talks
//! to a node, a participant or another node shares, and nothing else.
//!
//! - [`v1`]: the versioned gRPC API (`dtx.v1`), compiled from the `.proto`
//!   files under `proto/dtx/v1/` (the source of truth; they document every
//!   field), and [`FILE_DESCRIPTOR_SET`], their descriptors for reflection.
//! - [`limits`]: documented request limits, each name with its unit.
//! - [`metadata`]: the gRPC metadata keys (the txid a request carries,
//!   leader hints, "not applied", the Raft transport's cluster id) and
//!   their readers.
//! - [`trace`]: the W3C `traceparent` / `tracestate` headers that carry a
//!   trace from the client through the nodes to the participants.
//! - [`endpoint`]: the one parser of addresses.
//! - [`names`]: the names of the API's enumerations, as tools show them.
//!
//! It depends on tonic and prost only (what the generated code needs): no
//! transport, no TLS, no Raft, no storage. Channels, the unary transport
//! and the accepted-connection stream are `dtx-transport`'s; TLS settings,
//! identities and the authorising layer are `dtx-tls`'s
//! (docs/adr/0044-crate-lines.md).
pub mod v1 {
    tonic::include_proto!("dtx.v1");
}

/// The encoded `FileDescriptorSet` of every `dtx.v1` file (with the
/// documentation comments), as compiled at build time: what a node's
/// server reflection serves, so `grpcurl` needs no `.proto` files.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/dtx_v1_descriptor.bin"));

pub mod endpoint;
pub mod limits;
pub mod metadata;
pub mod names;
pub mod trace;

pub use endpoint::endpoint;
pub use endpoint::ADDRESS_FORMS;
pub use metadata::attach_incarnation;
pub use metadata::attach_txid;
pub use metadata::incarnation_of;
pub use metadata::txid_of;
pub use metadata::INCARNATION_METADATA_KEY;
pub use metadata::TXID_METADATA_KEY;
