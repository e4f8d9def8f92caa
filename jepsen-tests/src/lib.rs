//! Fault-injection harness in the manner of Jepsen (issue 4).
//!
//! - `history`: the recorded operations (JSON lines).
//! - `checker`: finds anomalies in a history (safety and liveness).
//! - `plot`: latency and throughput over time as PNG, faults shaded.

pub mod checker;
pub mod history;
pub mod plot;
