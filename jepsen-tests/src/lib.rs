//! Fault-injection harness (not implemented yet: issue 4).
//!
//! It will run the real coordinator and participant binaries under kill -9,
//! pauses, partitions and crash points, record a history, and check it for
//! the anomalies listed in DESIGN.md. Nothing in this crate is used yet.
