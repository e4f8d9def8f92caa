//! What a participant service exports to Prometheus (issue 13, item 3):
//! the HELP text of every metric the SDK emits ([`describe`], to call once
//! after the service installed its recorder) and the in-doubt gauges the
//! recovery loop sets ([`report_in_doubt`]).
//!
//! The SDK records through the `metrics` facade only; the service picks
//! the exporter (the example bank: `bank-serve --metrics-addr`, with
//! metrics-exporter-prometheus). Every `metrics::<kind>!("dtx_...")` in
//! this crate and in `dtx-tls` (the participant server's TLS and
//! authentication edge) has an entry in [`METRICS`]; a unit test scans the
//! sources. Labels are bounded: `participant` is the id the service is
//! enlisted with, never a txid.

use std::time::Duration;

use metrics::Unit;

use crate::participant::InDoubtSummary;

/// A metric's type, as its macro records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One metric the SDK may emit: name, type, unit, HELP text.
pub struct Described {
    pub name: &'static str,
    pub kind: Kind,
    pub unit: Unit,
    pub help: &'static str,
}

const fn m(name: &'static str, kind: Kind, unit: Unit, help: &'static str) -> Described {
    Described { name, kind, unit, help }
}

use Kind::Counter as C;
use Kind::Gauge as G;

/// Every metric a participant service built on the SDK emits, with its
/// HELP text (docs/operations.md, "Metrics", says more).
#[rustfmt::skip]
pub const METRICS: &[Described] = &[
    m("dtx_participant_in_doubt", G, Unit::Count, "Transactions this participant holds in doubt: voted YES, decision not known yet (locks held), by participant."),
    m("dtx_participant_oldest_in_doubt_age_seconds", G, Unit::Seconds, "How long the oldest in-doubt transaction has held its YES vote, by participant; 0 when none."),
    m("dtx_participant_recovery_lookups_total", C, Unit::Count, "In-doubt transactions recovery asked the cluster about, by outcome: commit, abort, unknown_presumed_abort (no record: rolled back), pending (undecided: still held), error (the cluster could not be asked)."),
    m("dtx_participant_recovery_errors_total", C, Unit::Count, "Recovery passes that could not list the in-doubt transactions (retried on the next pass)."),
    m("dtx_participant_log_inconsistencies_total", C, Unit::Count, "In-doubt index entries whose record is not in doubt (a damaged log); should stay 0."),
    m("dtx_participant_store_failures_total", C, Unit::Count, "Times the participant store stopped on a failed write or fsync, by disk_full; the service exits and is restarted."),
    m("dtx_participant_pg_prepared_open", G, Unit::Count, "PostgreSQL participant: its prepared transactions open in pg_prepared_xacts, by participant."),
    m("dtx_participant_pg_prepared_oldest_age_seconds", G, Unit::Seconds, "PostgreSQL participant: age of the oldest of them, by participant; 0 when none."),
    // The server's edge (dtx-tls).
    m("dtx_undecodable_requests_total", C, Unit::Count, "Requests refused before any handler because they could not be decoded, by server."),
    m("dtx_rate_limited_total", C, Unit::Count, "Calls refused by the per-identity rate limit, by server."),
    m("dtx_auth_refusals_total", C, Unit::Count, "Calls refused before any handler ran, by server and code (unauthenticated, permission_denied)."),
    m("dtx_tls_handshake_failures_total", C, Unit::Count, "TLS handshakes that failed or took more than 10 s."),
    m("dtx_tls_client_certificates_refused_total", C, Unit::Count, "Client certificates that prove no identity."),
    m("dtx_tls_reloads_total", C, Unit::Count, "Certificate files re-read after a change, by side (server, client)."),
    m("dtx_tls_reload_failures_total", C, Unit::Count, "Changed certificate files that could not be used, by side."),
];

/// Registers the HELP text and unit of every metric in [`METRICS`] with the
/// installed recorder (call it once, after installing one).
pub fn describe() {
    for d in METRICS {
        match d.kind {
            Kind::Counter => metrics::describe_counter!(d.name, d.unit, d.help),
            Kind::Gauge => metrics::describe_gauge!(d.name, d.unit, d.help),
            Kind::Histogram => metrics::describe_histogram!(d.name, d.unit, d.help),
        }
    }
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
    use std::collections::BTreeMap;
    use std::path::Path;

    use super::*;

    /// Every `metrics::<kind>!("name"` in the `.rs` files under `dir`.
    fn emitted(dir: &Path, out: &mut Vec<(String, Kind, String)>) {
        for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let p = e.unwrap().path();
            if p.is_dir() {
                emitted(&p, out);
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap();
            for (mac, kind) in [("counter!(", C), ("gauge!(", G), ("histogram!(", Kind::Histogram)] {
                let mut at = 0;
                while let Some(i) = text[at..].find(mac) {
                    let start = at + i;
                    at = start + mac.len();
                    let before = text[..start].chars().next_back();
                    if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                        continue;
                    }
                    let Some(lit) = text[at..].trim_start().strip_prefix('"') else {
                        continue;
                    };
                    let name = &lit[..lit.find('"').unwrap()];
                    let real = name
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
                    if name.starts_with("dtx_") && real {
                        out.push((name.to_string(), kind, p.display().to_string()));
                    }
                }
            }
        }
    }

    #[test]
    fn every_metric_emitted_has_help_text_and_its_type() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut found = Vec::new();
        emitted(&root.join("src"), &mut found);
        emitted(&root.join("../tls/src"), &mut found);
        let described: BTreeMap<&str, &Described> = METRICS.iter().map(|d| (d.name, d)).collect();
        assert_eq!(described.len(), METRICS.len(), "a metric is described twice");
        for (name, kind, file) in &found {
            let d = described
                .get(name.as_str())
                .unwrap_or_else(|| panic!("{name} ({file}) has no entry in metrics::METRICS (HELP text)"));
            assert_eq!(d.kind, *kind, "{name} ({file})");
        }
        for d in METRICS {
            assert!(
                found.iter().any(|(n, _, _)| n == d.name),
                "{} is described but never emitted",
                d.name
            );
        }
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
