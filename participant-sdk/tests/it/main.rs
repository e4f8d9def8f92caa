//! The participant SDK's integration tests, as one test binary (`it`): each
//! module `tNN_*` is one area (docs/testing.md lists them by invariant),
//! with the shared helpers in `common`. One binary links the whole stack
//! once.
//!
//! Run one module's tests with a filter on its module path, e.g.
//! `cargo test -p participant-sdk --test it -- t10_store::`. The PostgreSQL
//! modules (t50, t52, t53, t54, t61, t70) are compiled with the `postgres` feature
//! only (`--all-features`); the crash test of t60 with `failpoints`. The
//! tests that re-run this binary as a child process (t20, t60) name their
//! child test by its full path (`t20_store_crash::child_worker`).
//!
//! Tests of different modules now run at the same time in one process
//! under `cargo test` (they ran one binary after another before). None of
//! them changes process-wide state (environment, working directory, a
//! global metrics recorder or subscriber) or takes a fixed port: children
//! get their settings through their own environment, metrics recorders are
//! thread-local, listeners bind port 0, and each disk-full test mounts a
//! tmpfs of its own.

mod common;

mod t10_store;
mod t20_store_crash;
mod t30_disk_full;
mod t40_apply_decisions;
mod t41_prepare_many;
mod t42_no_reason;
mod t43_inspect;
mod t44_incarnations;
mod t45_branch_marks;
mod t50_postgres;
mod t52_pg_settings;
mod t53_pg_tls;
mod t54_pg_branch_restrictions;
mod t60_saga_steps;
mod t61_saga_steps_postgres;
mod t62_saga_outside_calls;
mod t70_outbox_postgres;
mod t71_outbox_store;
