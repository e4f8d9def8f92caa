//! The versioned gRPC API of the coordinator (`dtx.v1`).
//!
//! The `.proto` files under `proto/dtx/v1/` are the source of truth and
//! document every field; this crate only compiles them.
pub mod v1 {
    tonic::include_proto!("dtx.v1");
}
