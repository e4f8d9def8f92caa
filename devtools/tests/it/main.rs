//! The process integration tests, as one test binary (`it`): each module
//! `tNN_*` is one area (docs/testing.md lists them by invariant), with the
//! shared harness in `common`. One binary links the whole stack once.
//! They run the development binary `dtx-dev` (its node commands are the
//! `coordinator` binary's, the same code from dtx-cli) as real processes.
//!
//! Run one module's tests with a filter on its module path, e.g.
//! `cargo test -p dtx-devtools --test it -- t20_leader_failover::`. The
//! binary under test always has its crash points (the failpoints feature
//! comes in through this package's dev-dependencies), so the crash-point
//! modules run in every `cargo test`; a crash point fires only in a process
//! started with `FAILPOINTS` set.
//!
//! Tests of different modules now run at the same time in one process (they
//! ran one binary after another before): the demos, which were each in a
//! file of their own so as not to run together, take `common::DEMO_LOCK`
//! (in `common::run_demo_audited`).

mod common;

mod t100_operator_cli;
mod t101_health;
mod t102_backup_restore;
mod t103_metrics;
mod t104_console;
mod t105_participant_inspect;
mod t106_trace_context;
mod t107_restore_drill;
mod t110_sagas;
mod t111_saga_crash_points;
mod t112_saga_demo;
mod t113_saga_outside_calls;
mod t114_identities;
mod t115_operator_drill;
mod t116_bounded_logs_and_labels;
mod t117_heuristic_one_phase;
mod t118_participant_addresses;
mod t119_saga_api;
mod t120_branches;
mod t121_postgres_branches;
mod t122_shop_demo;
mod t123_saga_outputs_pending_approvals;
mod t124_saga_inventory_postgres;
mod t125_conformance;
mod t126_python_sdk;
mod t20_leader_failover;
mod t21_full_restart;
mod t22_crash_loop;
mod t23_restarted_leader_reads;
mod t24_leader_flush_beside_replication;
mod t25_commit_index_rides_the_next_append;
mod t26_power_cut;
mod t30_decide_race;
mod t40_api;
mod t41_enlist_refuses_unusable_addresses;
mod t42_ambiguous_outcomes;
mod t50_data_dir_safety;
mod t51_disk_full;
mod t52_bank_disk_full;
mod t53_fatal_exit_is_bounded;
mod t60_partition_reads;
mod t61_cut_off_leader;
mod t70_membership_snapshot;
mod t71_removed_node_id_is_never_reused;
mod t72_isolated_node_rejoins_quietly;
mod t80_two_phase_commit;
mod t81_participant_log;
mod t82_fair_background_work;
mod t83_read_only_voters_get_no_phase_two;
mod t84_operator_commit_needs_every_yes;
mod t85_crash_points;
mod t86_grouped_phase_two;
mod t87_grouped_prepares;
mod t88_postgres_crash_points;
mod t89_postgres_restart;
mod t90_bank_demo;
mod t91_dev_reports_an_exit_once;
mod t93_postgres_bank;
mod t95_tls;
mod t96_demo_tls;
mod t97_connection_admission;
