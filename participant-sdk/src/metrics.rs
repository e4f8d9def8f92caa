//! What a participant service exports to Prometheus: the HELP text of every
//! metric the SDK emits ([`describe`], to call once after the service
//! installed its recorder) and the in-doubt gauges the recovery loop sets
//! ([`report_in_doubt`]).
//!
//! The SDK records through the `metrics` facade only; the service picks
//! the exporter (the example bank: `bank-serve --metrics-addr`, with
//! metrics-exporter-prometheus). Every `metrics::<kind>!("dtx_...")` in
//! this crate has an entry in [`METRICS`] (`dtx-tls` describes its own, the
//! server's edge); a unit test scans the sources. Labels are bounded: `participant` is the id the service is
//! enlisted with, never a txid.

use std::time::Duration;

use metrics::Unit;

use crate::participant::InDoubtSummary;

use dtx_tls::described::described as m;
pub use dtx_tls::described::Described;
pub use dtx_tls::described::Kind;
use dtx_tls::described::EDGE_METRICS;

use Kind::Counter as C;
use Kind::Gauge as G;

/// Every metric a participant service built on the SDK emits, with its
/// HELP text (docs/operations.md, "Metrics", says more).
#[rustfmt::skip]
pub const METRICS: &[Described] = &[
    m("dtx_participant_in_doubt", G, Unit::Count, "Transactions this participant holds in doubt: voted YES, decision not known yet (locks held), by participant."),
    m("dtx_participant_oldest_in_doubt_age_seconds", G, Unit::Seconds, "How long the oldest in-doubt transaction has held its YES vote, by participant; 0 when none."),
    m("dtx_participant_recovery_lookups_total", C, Unit::Count, "In-doubt transactions recovery asked the cluster about, by outcome: commit, abort, unknown_presumed_abort (no record: rolled back), pending (undecided: still held), other_incarnation (the cluster did not hand out this txid in the incarnation it came with: another cluster's, or from after the backup it was restored from; nothing presumed, still held for an operator), error (the cluster could not be asked)."),
    m("dtx_participant_recovery_errors_total", C, Unit::Count, "Recovery passes that could not list the in-doubt transactions (retried on the next pass)."),
    m("dtx_participant_log_inconsistencies_total", C, Unit::Count, "In-doubt index entries whose record is not in doubt (a damaged log); should stay 0."),
    m("dtx_participant_store_failures_total", C, Unit::Count, "Times the participant store stopped on a failed write or fsync, by disk_full; the service exits and is restarted."),
    m("dtx_participant_pg_prepared_open", G, Unit::Count, "PostgreSQL participant: its prepared transactions open in pg_prepared_xacts, by participant."),
    m("dtx_participant_pg_prepared_oldest_age_seconds", G, Unit::Seconds, "PostgreSQL participant: age of the oldest of them, by participant; 0 when none."),
    m("dtx_participant_pg_prepared_slots_free", G, Unit::Count, "PostgreSQL participant: max_prepared_transactions minus the prepared transactions of every database of the server, as of the last recovery pass, by participant; at 0 every Prepare votes NO."),
    m("dtx_participant_pg_prepared_slots_exhausted_total", C, Unit::Count, "PostgreSQL participant: Prepares that voted NO because PostgreSQL had no free prepared-transaction slot (SQLSTATE 53200), by participant; raise max_prepared_transactions (shared by every database of the server)."),
    m("dtx_participant_pg_not_preparable_total", C, Unit::Count, "PostgreSQL participant: Prepares and branches that voted NO because the handler did what PREPARE TRANSACTION refuses (a temporary table, LISTEN/UNLISTEN/NOTIFY, a cursor WITH HOLD, an exported snapshot), found by a branch's early check or by SQLSTATE 0A000, by participant; a defect of the handler, should stay 0."),
    m("dtx_participant_pg_permission_denied_total", C, Unit::Count, "PostgreSQL participant: COMMIT PREPARED / ROLLBACK PREPARED refused for lack of rights (SQLSTATE 42501: a transaction another role prepared, after a role rotation), by participant and statement (commit_prepared, rollback_prepared); the decision is delivered again until the fix is in (docs/operations.md)."),
    m("dtx_participant_pg_handler_timeouts_total", C, Unit::Count, "PostgreSQL participant: Prepares and one-phase commits that voted NO because PostgreSQL gave up a wait of the handler, by participant and kind (lock_timeout, statement_timeout, deadlock)."),
    m("dtx_participant_pg_pool_wait_timeouts_total", C, Unit::Count, "PostgreSQL participant: messages that found no free pooled connection within pool_wait_timeout_ms (failed as unavailable, retried by the coordinator), by participant and pool (handlers, decisions)."),
    m("dtx_participant_pg_calls_cancelled_total", C, Unit::Count, "PostgreSQL participant: messages whose call was dropped while their PostgreSQL work ran (the caller gave up); the statement was cancelled and its connection closed, by participant."),
    m("dtx_outbox_oldest_unpublished_age_seconds", G, Unit::Seconds, "Outbox: how long the oldest message not published yet (pending or dead-lettered) has waited, by outbox; 0 when none. Set by the relays after each pass."),
    m("dtx_outbox_published_total", C, Unit::Count, "Outbox: messages the relays published, by outbox."),
    m("dtx_outbox_publish_failures_total", C, Unit::Count, "Outbox: failed publish attempts (retried with backoff, or dead-lettered at the last one), by outbox."),
    m("dtx_outbox_dead_lettered_total", C, Unit::Count, "Outbox: messages moved to the dead-letter state after max_attempts failed attempts, by outbox; each blocks its aggregate until requeued or discarded."),
    m("dtx_inbox_duplicates_total", C, Unit::Count, "Inbox: messages received again and skipped (their id was recorded), by inbox."),
    m("dtx_step_calls_total", C, Unit::Count, "Saga step service calls, by call (forward, compensate, status) and outcome (ok, failed, noop, stale; applied, not_applied for status; invalid, conflict, error)."),
    m("dtx_step_duplicates_total", C, Unit::Count, "Saga step calls whose operation id was answered before, by call (forward, compensate): answered from the inbox, the handler not run again."),
    m("dtx_step_outside_total", C, Unit::Count, "Saga step services' calls to an outside system and questions about them, by call (call, status, fence) and outcome (answered, no_answer for a call; done, not_done, unknown for a status question or fence)."),
    m("dtx_step_fingerprint_conflicts_total", C, Unit::Count, "Saga step calls refused because their operation id was recorded here with another fingerprint (other work under the same id), by call (forward, compensate); nothing was done."),
];

/// Registers the HELP text and unit of every metric in [`METRICS`] and of
/// the server's edge (`dtx-tls`'s `EDGE_METRICS`) with the installed
/// recorder (call it once, after installing one).
pub fn describe() {
    dtx_tls::described::describe(METRICS);
    dtx_tls::described::describe(EDGE_METRICS);
}

/// Sets `dtx_participant_in_doubt{participant}` and
/// `dtx_participant_oldest_in_doubt_age_seconds{participant}` (0 when none
/// is in doubt or the age is unknown).
pub fn report_in_doubt(participant_id: &str, s: &InDoubtSummary) {
    let label = participant_id.to_string();
    metrics::gauge!("dtx_participant_in_doubt", "participant" => label.clone()).set(s.count as f64);
    let age = if s.count == 0 {
        Duration::ZERO
    } else {
        s.oldest_age.unwrap_or(Duration::ZERO)
    };
    metrics::gauge!("dtx_participant_oldest_in_doubt_age_seconds", "participant" => label).set(age.as_secs_f64());
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn every_metric_emitted_has_help_text_and_its_type() {
        let found = dtx_tls::described::emitted_in(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src")).unwrap();
        let wrong = dtx_tls::described::mismatches(&found, METRICS);
        assert!(wrong.is_empty(), "{wrong:#?}");
    }

    #[test]
    fn the_in_doubt_gauges_render_with_help() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe();
            report_in_doubt(
                "bank-a",
                &InDoubtSummary {
                    count: 2,
                    oldest_age: Some(Duration::from_millis(2500)),
                },
            );
            report_in_doubt("bank-b", &InDoubtSummary::default());
        });
        let text = handle.render();
        for line in [
            "# HELP dtx_participant_in_doubt ",
            "# TYPE dtx_participant_in_doubt gauge",
            r#"dtx_participant_in_doubt{participant="bank-a"} 2"#,
            r#"dtx_participant_oldest_in_doubt_age_seconds{participant="bank-a"} 2.5"#,
            r#"dtx_participant_in_doubt{participant="bank-b"} 0"#,
            r#"dtx_participant_oldest_in_doubt_age_seconds{participant="bank-b"} 0"#,
        ] {
            assert!(text.contains(line), "{line:?} missing from {text}");
        }
    }
}
