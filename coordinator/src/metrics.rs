//! What a node exports to Prometheus: the recorder's settings (explicit
//! histogram buckets, so `_bucket` series add up across nodes), the HELP text
//! of every metric this process emits, and the gauges computed from the
//! replicated transaction table once a second.
//!
//! Every `metrics::counter!/gauge!/histogram!("dtx_...")` in this crate
//! has an entry in [`METRICS`] (`dtx-tls` describes its own, the servers'
//! edge); a unit test scans the sources and fails on a metric without one,
//! or with the wrong type, or an entry nothing records. Labels are bounded: request methods, gRPC codes, outcomes,
//! never a txid; participant ids (chosen by applications when they
//! enlist) only through [`participant_label`]: the first
//! [`PARTICIPANT_LABELS_MAX`] distinct ids this process sees have a label
//! of their own, every later one is counted as `other`
//! (docs/adr/0038-bounded-logs-and-labels.md).

use metrics::Unit;
use metrics_exporter_prometheus::Matcher;
use metrics_exporter_prometheus::PrometheusBuilder;

use crate::sm::TxTable;

/// Buckets (upper bounds, seconds) of every latency histogram (names that
/// end in `_seconds`): from 100 µs (a call answered from memory) to 10 s
/// (past any sane deadline; slower calls land in `+Inf`).
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Buckets of every other histogram: counts of things grouped together
/// (commands per Raft entry, appends per fsync, items per message), powers
/// of two up to 4096.
pub const SIZE_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
];

/// The recorder's settings: every histogram renders as a Prometheus
/// histogram (`_bucket{le=..}`, `_sum`, `_count`) with fixed buckets, never
/// as a summary (quantiles of one node cannot be combined with another's).
/// Install it with `install_recorder()` (the node serves the text itself)
/// and then call [`describe`].
pub fn exporter() -> PrometheusBuilder {
    PrometheusBuilder::new()
        .set_buckets(SIZE_BUCKETS)
        .expect("size buckets are not empty")
        .set_buckets_for_metric(Matcher::Suffix("_seconds".to_string()), LATENCY_BUCKETS)
        .expect("latency buckets are not empty")
}

use dtx_tls::described::described as m;
pub use dtx_tls::described::Described;
pub use dtx_tls::described::Kind;
use dtx_tls::described::EDGE_METRICS;

use Kind::Counter as C;
use Kind::Gauge as G;
use Kind::Histogram as H;

/// Every metric a node emits (this crate and `dtx-tls`), with its HELP
/// text. docs/operations.md ("Metrics") says more about each.
#[rustfmt::skip]
pub const METRICS: &[Described] = &[
    // 2PC: decisions, delivery, background work.
    m("dtx_decisions_total", C, Unit::Count, "Decisions recorded, by outcome (COMMIT, ABORT); counted by every node when it applies the entry."),
    m("dtx_settlements_total", C, Unit::Count, "Operators' settlements of another incarnation's txid recorded (admin txn settle-other, ADR 0040), by outcome (COMMIT, ABORT); counted by every node when it applies the entry (first recording only)."),
    m("dtx_reaper_aborts_total", C, Unit::Count, "ABORT decisions the deadline reaper recorded (leader)."),
    m("dtx_forgotten_total", C, Unit::Count, "Decided, fully acked records the forget loop removed (leader)."),
    m("dtx_deliveries_total", C, Unit::Count, "Decisions delivered to a participant and acked, by outcome (leader)."),
    m("dtx_delivery_failures_total", C, Unit::Count, "Failed delivery attempts, each retried with backoff, by kind (no_answer, refused) and participant (the id it was enlisted with; past the first 32 distinct ids, other) (leader)."),
    m("dtx_never_answered_given_up_total", C, Unit::Count, "Transactions for which the leader stopped calling an address that never answered this node within txn.never_answered_give_up_ms, by kind (abort_delivery, one_phase_commit); shown by admin txn show (leader)."),
    m("dtx_prepare_failures_total", C, Unit::Count, "Prepares that got no vote (no answer, an error), each counted as NO, by participant (as in dtx_delivery_failures_total); logged once per participant per 10 s (leader)."),
    m("dtx_participant_outages_total", C, Unit::Count, "Times a participant address started failing deliveries (leader)."),
    m("dtx_participants_failing", G, Unit::Count, "Participant addresses failing deliveries now (leader)."),
    m("dtx_participant_protocol_errors_total", C, Unit::Count, "Commit or Abort refused FAILED_PRECONDITION by a participant (protocol violation or stale term); should stay 0 (leader)."),
    m("dtx_one_phase_commits_total", C, Unit::Count, "One-phase commits decided by their participant's answer, by outcome (leader)."),
    m("dtx_heuristic_decisions_total", C, Unit::Count, "Heuristic decisions an operator recorded for one-phase commits whose participant was declared lost, by outcome (leader)."),
    m("dtx_branch_registrations_total", C, Unit::Count, "Branches registered with their vote (RegisterBranch recorded, repeats included), by vote (YES, NO, READ_ONLY)."),
    m("dtx_branch_refusals_total", C, Unit::Count, "Branch registrations refused, by kind: too-late (the transaction was preparing, decided, forgotten, past its deadline or of another incarnation), fenced (the branch was fenced out), conflict (another vote from the same branch)."),
    m("dtx_branch_fences_total", C, Unit::Count, "Branches fenced out of an open transaction by GetBranchDecision (a branch that prepared but whose registration never arrived, asked by its recovery)."),
    m("dtx_branch_commits_in_one_write_total", C, Unit::Count, "Commits whose every member had registered as a branch with its vote: decided in one write, no Prepare sent (leader)."),
    m("dtx_heuristic_contradictions_total", C, Unit::Count, "Participants declared lost that answered their one-phase commit after all, with the other outcome than the operator's heuristic decision: reconcile by hand (leader)."),
    m("dtx_one_write_commits_total", C, Unit::Count, "BeginAndCommits recorded with their decision in one write, by outcome (leader)."),
    m("dtx_txid_ranges_reserved_total", C, Unit::Count, "ReserveTxids writes: txid ranges reserved for one-write commits (leader)."),
    m("dtx_writes_refused_no_quorum_total", C, Unit::Count, "Writes refused at once by a leader that heard from no quorum for too long."),
    m("dtx_participant_calls_withheld_total", C, Unit::Count, "Calls to participants and saga step services not sent because this node did not lead or heard from no quorum within the serving limit (invariant 13)."),
    // The replicated table (every node; meaningful on the leader).
    m("dtx_transactions", G, Unit::Count, "Transaction records held in the state machine (in memory and retained on disk)."),
    m("dtx_transactions_retained", G, Unit::Count, "Decided, fully acknowledged transaction records kept on disk only until their retention ends (ADR 0050): not in memory."),
    // Sagas (the leader's orchestrator).
    m("dtx_sagas", G, Unit::Count, "Sagas by state (RUNNING, COMPENSATING, PARKED), as the leader's orchestrator last scanned them."),
    m("dtx_sagas_forgotten_total", C, Unit::Count, "Ended sagas the leader forgot after saga.retention_ms."),
    m("dtx_saga_parked_total", C, Unit::Count, "Sagas the orchestrator parked for an operator (a limit reached, an UNKNOWN it could not settle, expired rights, no registered option left)."),
    m("dtx_saga_calls_total", C, Unit::Count, "Step-service calls the orchestrator journaled, by call (forward, compensation) and outcome (OK, FAILED, UNKNOWN, NOOP, STALE)."),
    m("dtx_saga_reconciliations_total", C, Unit::Count, "Status queries that settled a step call's UNKNOWN outcome (or an intent found on resume), by call."),
    m("dtx_saga_unknown_seconds", H, Unit::Seconds, "Time a step call's outcome stayed UNKNOWN before a status query settled it, by call."),
    m("dtx_saga_status_query_seconds", H, Unit::Seconds, "Latency of one status query to a step service."),
    m("dtx_preparing_transactions", G, Unit::Count, "Transactions in PREPARING (votes being collected)."),
    m("dtx_undelivered_transactions", G, Unit::Count, "Decided transactions with a participant (not dropped by an operator) whose ack is not recorded."),
    m("dtx_oldest_in_doubt_age_seconds", G, Unit::Seconds, "Age (now - begin) of the oldest transaction in PREPARING or decided and not acked by every participant; 0 when none."),
    m("dtx_oldest_undelivered_age_seconds", G, Unit::Seconds, "Time since the decision of the oldest decided transaction not acked by every participant; 0 when none."),
    // Batching.
    m("dtx_batch_commands", H, Unit::Count, "Commands per Raft entry built by the batcher (leader)."),
    m("dtx_ack_batch_acks", H, Unit::Count, "Participant acks proposed together in one write (leader)."),
    m("dtx_delivery_batch_items", H, Unit::Count, "Decisions carried by one ApplyDecisions message to a participant (leader)."),
    m("dtx_prepare_batch_items", H, Unit::Count, "Prepares carried by one PrepareMany message to a participant (leader)."),
    m("dtx_prepare_riding_decisions", H, Unit::Count, "Decisions riding in one PrepareMany message that carried any (leader, ADR 0030)."),
    // Storage and Raft.
    m("dtx_log_flushes_total", C, Unit::Count, "fsyncs of the Raft log."),
    m("dtx_log_flush_group_appends", H, Unit::Count, "Raft log appends completed by one fsync."),
    m("dtx_log_appends_reported_before_sync_total", C, Unit::Count, "The leader's own Raft log appends reported before their fsync, so they reach the followers while it runs (ADR 0028)."),
    m("dtx_apply_wait_for_log_sync_seconds", H, Unit::Seconds, "Time an apply waited for this node's own Raft log to have its entries on disk (ADR 0028)."),
    m("dtx_raft_appends_deferred_total", C, Unit::Count, "AppendEntries without entries (a newer commit index, or a heartbeat) not sent to a follower that accepted one at the same place within raft.commit_index_defer_max_ms: the follower learns the commit index from its next AppendEntries (ADR 0031)."),
    m("dtx_raft_appends_held_for_log_sync_total", C, Unit::Count, "AppendEntries not sent because this node's Raft log has waited longer than raft.election_timeout_min_ms for an fsync (a hung disk; the followers elect another leader)."),
    m("dtx_storage_flush_seconds", H, Unit::Seconds, "Time to make the node's writes durable: sled's flush and the fsync of its files after it."),
    m("dtx_snapshots_built_total", C, Unit::Count, "Snapshots this node built."),
    m("dtx_snapshots_installed_total", C, Unit::Count, "Snapshots received from the leader and installed."),
    m("dtx_snapshot_last_build_seconds", G, Unit::Seconds, "How long this node took to build its last snapshot (writing what was pending, reading the retained records, encoding)."),
    m("dtx_snapshot_last_install_seconds", G, Unit::Seconds, "How long this node took to install the last snapshot it received (decoding, replacing its stored state)."),
    m("dtx_snapshot_last_bytes", G, Unit::Bytes, "Size of the last snapshot this node built or installed."),
    m("dtx_backups_total", C, Unit::Count, "Backup requests, by result (built, refused)."),
    m("dtx_serving", G, Unit::Count, "1 while this node serves (it is, or hears from, a leader a majority acknowledges)."),
    m("dtx_raft_term", G, Unit::Count, "Current Raft term; a steady rise means repeated elections."),
    m("dtx_raft_is_leader", G, Unit::Count, "1 on the leader that serves."),
    m("dtx_raft_last_log_index", G, Unit::Count, "Index of the last Raft log entry."),
    m("dtx_raft_last_applied_index", G, Unit::Count, "Index of the last applied Raft log entry; compare across nodes for lag."),
    m("dtx_raft_snapshot_index", G, Unit::Count, "Index covered by the last snapshot."),
    m("dtx_raft_elections_enabled", G, Unit::Count, "1 while this node may start elections (the quorum probe switches them off when it cannot reach a quorum)."),
    m("dtx_raft_elections_switched_off_total", C, Unit::Count, "Times the quorum probe switched this node's elections off."),
    m("dtx_raft_foreign_cluster_calls_total", C, Unit::Count, "Raft calls refused because they carried another cluster_id; should stay 0."),
    // The API.
    m("dtx_api_requests_total", C, Unit::Count, "Coordinator and Admin calls, by method (the gRPC method: Begin, Commit, ...) and gRPC code."),
    m("dtx_api_request_seconds", H, Unit::Seconds, "Latency of the same calls as this node served them, by method and gRPC code (forwarded calls include the hop to the leader)."),
    m("dtx_api_forwarded_total", C, Unit::Count, "API calls forwarded once to the leader (non-leaders)."),
];

/// Registers the HELP text and unit of every metric in [`METRICS`] and of
/// the servers' edge (`dtx-tls`'s `EDGE_METRICS`) with the installed
/// recorder (call it once, after installing one; before, the descriptions
/// go nowhere).
pub fn describe() {
    dtx_tls::described::describe(METRICS);
    dtx_tls::described::describe(EDGE_METRICS);
}

/// The method label of an API call whose request type is `Req`: the gRPC
/// method's name (`BeginRequest` -> `Begin`). Every method of the
/// Coordinator and Admin services takes `<Method>Request` (a unit test
/// checks the .proto files).
pub fn grpc_method<Req>() -> &'static str {
    let name = std::any::type_name::<Req>().rsplit("::").next().unwrap_or("unknown");
    name.strip_suffix("Request").filter(|m| !m.is_empty()).unwrap_or(name)
}

/// Distinct participant ids that get a label of their own in this
/// process's metrics; later ones are labelled [`OTHER_PARTICIPANT`].
pub const PARTICIPANT_LABELS_MAX: usize = 32;

/// The label of every participant id past [`PARTICIPANT_LABELS_MAX`].
pub const OTHER_PARTICIPANT: &str = "other";

/// The `participant` label of `id`: the id itself if it is one of the
/// first [`PARTICIPANT_LABELS_MAX`] distinct ids seen by this process (for
/// its life), else [`OTHER_PARTICIPANT`]. Applications choose participant
/// ids; the series they make must not grow without bound.
pub fn participant_label(id: &str) -> String {
    static SEEN: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<String>>> = std::sync::OnceLock::new();
    let mut seen = SEEN
        .get_or_init(Default::default)
        .lock()
        .expect("participant labels lock");
    labelled(&mut seen, id, PARTICIPANT_LABELS_MAX)
}

/// [`participant_label`] over the table `seen`, with the bound `max`.
fn labelled(seen: &mut std::collections::HashSet<String>, id: &str, max: usize) -> String {
    if seen.contains(id) {
        return id.to_string();
    }
    if seen.len() < max && id != OTHER_PARTICIPANT {
        seen.insert(id.to_string());
        return id.to_string();
    }
    OTHER_PARTICIPANT.to_string()
}

/// How many entries of each index [`table_gauges`] looks at: bounded work
/// per second, however large the table.
pub const OLDEST_SCAN: usize = 64;

/// The gauges [`report_table`] sets.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TableGauges {
    pub preparing: usize,
    pub undelivered: usize,
    pub oldest_in_doubt_age_s: f64,
    pub oldest_undelivered_age_s: f64,
}

/// The table's gauges at `now_ms` (this node's clock, ms since the Unix
/// epoch; a record's times are its proposing leader's clock, so a small
/// skew between nodes shows, and an age is never negative).
///
/// The oldest ones are found without scanning the table: txids are handed
/// out in increasing order (a one-write commit's come from a range reserved
/// a little earlier), so the smallest txids of the PREPARING and
/// undelivered indexes are the oldest transactions, give or take the
/// transactions begun concurrently. The first [`OLDEST_SCAN`] of each index
/// are looked at and the earliest time among them taken: the proxy is off
/// only when more than that many were begun out of txid order.
pub fn table_gauges(table: &TxTable, now_ms: u64) -> TableGauges {
    let age = |t: u64| now_ms.saturating_sub(t) as f64 / 1000.0;
    let begun_of = |txid| table.get(txid).map(|r| r.begun_ms);
    let oldest_preparing = table.preparing_after(0).take(OLDEST_SCAN).filter_map(begun_of).min();
    let (oldest_undelivered_begun, oldest_decided) = table
        .undelivered_after(0)
        .take(OLDEST_SCAN)
        .filter_map(|txid| table.get(txid))
        .fold((None::<u64>, None::<u64>), |(b, d), r| {
            let decided = r.decision().map(|x| x.decided_ms);
            (
                Some(b.map_or(r.begun_ms, |b| b.min(r.begun_ms))),
                match (d, decided) {
                    (Some(d), Some(x)) => Some(d.min(x)),
                    (d, x) => d.or(x),
                },
            )
        });
    let oldest_begun = match (oldest_preparing, oldest_undelivered_begun) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    TableGauges {
        preparing: table.preparing_count(),
        undelivered: table.undelivered_count(),
        oldest_in_doubt_age_s: oldest_begun.map_or(0.0, age),
        oldest_undelivered_age_s: oldest_decided.map_or(0.0, age),
    }
}

/// Sets the table's gauges (`dtx_preparing_transactions`,
/// `dtx_undelivered_transactions`, `dtx_oldest_in_doubt_age_seconds`,
/// `dtx_oldest_undelivered_age_seconds`); called once a second by the node.
pub fn report_table(table: &TxTable, now_ms: u64) {
    let g = table_gauges(table, now_ms);
    metrics::gauge!("dtx_preparing_transactions").set(g.preparing as f64);
    // Decided but not acked by every participant: a number that only grows
    // points at a participant gone for good.
    metrics::gauge!("dtx_undelivered_transactions").set(g.undelivered as f64);
    metrics::gauge!("dtx_oldest_in_doubt_age_seconds").set(g.oldest_in_doubt_age_s);
    metrics::gauge!("dtx_oldest_undelivered_age_seconds").set(g.oldest_undelivered_age_s);
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::sm::Decision;
    use crate::sm::DecisionSource;
    use crate::sm::Outcome;
    use crate::sm::Participant;
    use crate::sm::Phase;
    use crate::sm::TxRecord;

    #[test]
    fn every_metric_emitted_has_help_text_and_its_type() {
        let found = dtx_tls::described::emitted_in(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src")).unwrap();
        assert!(found.len() > 40, "the scan found only {} metric calls", found.len());
        let wrong = dtx_tls::described::mismatches(&found, METRICS);
        assert!(wrong.is_empty(), "{wrong:#?}");
    }

    #[test]
    fn latency_histograms_are_in_seconds_and_the_others_count() {
        for d in METRICS.iter().filter(|d| d.kind == Kind::Histogram) {
            assert_eq!(
                d.name.ends_with("_seconds"),
                d.unit == Unit::Seconds,
                "{}: a latency histogram is named *_seconds (it gets the latency buckets), any other counts",
                d.name
            );
        }
        assert!(LATENCY_BUCKETS.windows(2).all(|w| w[0] < w[1]));
        assert!(SIZE_BUCKETS.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn histograms_render_with_buckets_and_help() {
        let recorder = exporter().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe();
            metrics::histogram!("dtx_api_request_seconds", "method" => "Begin", "code" => "Ok").record(0.003);
            metrics::histogram!("dtx_batch_commands").record(5.0);
        });
        let text = handle.render();
        assert!(text.contains("# HELP dtx_api_request_seconds "), "{text}");
        assert!(text.contains("# TYPE dtx_api_request_seconds histogram"), "{text}");
        assert!(
            text.contains(r#"dtx_api_request_seconds_bucket{method="Begin",code="Ok",le="0.005"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"dtx_api_request_seconds_bucket{method="Begin",code="Ok",le="0.0025"} 0"#),
            "{text}"
        );
        assert!(text.contains(r#"dtx_batch_commands_bucket{le="8"} 1"#), "{text}");
        assert!(text.contains(r#"dtx_batch_commands_bucket{le="4"} 0"#), "{text}");
        assert!(!text.contains("quantile="), "no summaries: {text}");
    }

    /// Participant ids (chosen by applications) label at most `max` series;
    /// the rest are `other`, and an id labelled once keeps its label.
    #[test]
    fn participant_labels_are_bounded() {
        let mut seen = std::collections::HashSet::new();
        let labels: Vec<String> = (0..100).map(|i| labelled(&mut seen, &format!("p{i}"), 4)).collect();
        assert_eq!(&labels[..4], ["p0", "p1", "p2", "p3"]);
        assert!(labels[4..].iter().all(|l| l == OTHER_PARTICIPANT), "{labels:?}");
        assert_eq!(labelled(&mut seen, "p2", 4), "p2", "a known id keeps its label");
        assert_eq!(seen.len(), 4, "nothing more is kept");
        let mut seen = std::collections::HashSet::new();
        assert_eq!(labelled(&mut seen, OTHER_PARTICIPANT, 4), OTHER_PARTICIPANT);
        assert!(seen.is_empty(), "\"other\" takes no place of its own");
        let distinct: std::collections::HashSet<String> =
            (0..1000).map(|i| participant_label(&format!("t-{i}"))).collect();
        assert!(distinct.len() <= PARTICIPANT_LABELS_MAX + 1, "{}", distinct.len());
    }

    #[test]
    fn the_method_label_is_the_grpc_method() {
        assert_eq!(grpc_method::<dtx_proto::v1::BeginRequest>(), "Begin");
        assert_eq!(grpc_method::<dtx_proto::v1::GetDecisionsRequest>(), "GetDecisions");
        assert_eq!(grpc_method::<dtx_proto::v1::ResolveRequest>(), "Resolve");
        // The convention it relies on: each method takes <Method>Request.
        for proto in [
            include_str!("../../proto/dtx/v1/coordinator.proto"),
            include_str!("../../proto/dtx/v1/admin.proto"),
        ] {
            let mut seen = 0;
            for line in proto.lines() {
                let Some(rest) = line.trim().strip_prefix("rpc ") else {
                    continue;
                };
                let (method, rest) = rest.split_once('(').unwrap();
                let input = rest.split(')').next().unwrap().trim();
                assert_eq!(input, format!("{}Request", method.trim()), "{line}");
                seen += 1;
            }
            assert!(seen >= 5, "{seen} methods found");
        }
    }

    fn record(txid: u64, begun_ms: u64, phase: Phase, acked: &[bool]) -> TxRecord {
        TxRecord {
            txid,
            idempotency_key: format!("k{txid}"),
            fingerprint: [0; 32],
            begun_ms,
            deadline_ms: begun_ms + 60_000,
            phase,
            participants: acked
                .iter()
                .enumerate()
                .map(|(i, a)| Participant {
                    id: format!("p{i}"),
                    address: format!("127.0.0.1:{}", 1000 + i),
                    payload: Vec::new(),
                    acked: *a,
                })
                .collect(),
            one_phase: false,
        }
    }

    fn decided(ms: u64) -> Phase {
        Phase::Decided(Decision {
            outcome: Outcome::Commit,
            source: DecisionSource::Driver,
            term: 1,
            decided_ms: ms,
            note: String::new(),
        })
    }

    #[test]
    fn table_gauges_take_the_oldest_in_doubt_and_undelivered() {
        assert_eq!(table_gauges(&TxTable::new(), 50_000), TableGauges::default());
        let table = TxTable::from_parts(
            10,
            [
                record(1, 1_000, decided(2_000), &[true, true]),  // done: not counted
                record(2, 3_000, decided(9_000), &[true, false]), // undelivered
                record(3, 4_000, Phase::Preparing, &[false, false]),
                record(4, 5_000, decided(6_000), &[false, true]), // undelivered, decided earlier
                record(5, 7_000, Phase::Active, &[false]),        // not in doubt
            ],
        );
        let g = table_gauges(&table, 20_000);
        assert_eq!(g.preparing, 1);
        assert_eq!(g.undelivered, 2);
        assert_eq!(g.oldest_in_doubt_age_s, 17.0, "txid 2, begun at 3 s");
        assert_eq!(g.oldest_undelivered_age_s, 14.0, "txid 4, decided at 6 s");
        // A clock behind the records' never gives a negative age.
        assert_eq!(table_gauges(&table, 0).oldest_in_doubt_age_s, 0.0);
        // Only PREPARING left.
        let table = TxTable::from_parts(10, [record(3, 4_000, Phase::Preparing, &[false])]);
        let g = table_gauges(&table, 4_500);
        assert_eq!((g.oldest_in_doubt_age_s, g.oldest_undelivered_age_s), (0.5, 0.0));
    }

    #[test]
    fn report_table_sets_the_gauges() {
        let recorder = exporter().build_recorder();
        let handle = recorder.handle();
        let table = TxTable::from_parts(10, [record(2, 3_000, decided(9_000), &[false])]);
        metrics::with_local_recorder(&recorder, || {
            describe();
            report_table(&table, 12_000);
        });
        let text = handle.render();
        for line in [
            "dtx_undelivered_transactions 1",
            "dtx_preparing_transactions 0",
            "dtx_oldest_in_doubt_age_seconds 9",
            "dtx_oldest_undelivered_age_seconds 3",
            "# HELP dtx_oldest_undelivered_age_seconds ",
        ] {
            assert!(text.contains(line), "{line:?} missing from {text}");
        }
    }
}
