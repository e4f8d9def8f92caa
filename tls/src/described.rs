//! Metric descriptions (HELP text, type, unit), shared by every crate that
//! emits metrics: this one (the servers' edge: TLS, authentication, rate
//! limits), the node and the participant SDK. Each crate describes the
//! metrics it emits itself, in one table, and checks with [`emitted_in`]
//! in a unit test that every metric its sources record has an entry of the
//! right type, and that every entry is still recorded. The node and the
//! SDK register this crate's [`EDGE_METRICS`] beside their own.

use std::path::Path;

use metrics::Unit;

/// A metric's type, as its macro records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One metric a process may emit: name, type, unit, HELP text (labels are
/// named in the text).
#[derive(Debug)]
pub struct Described {
    pub name: &'static str,
    pub kind: Kind,
    pub unit: Unit,
    pub help: &'static str,
}

/// A [`Described`], short enough for one table line.
pub const fn described(name: &'static str, kind: Kind, unit: Unit, help: &'static str) -> Described {
    Described { name, kind, unit, help }
}

use Kind::Counter as C;

/// The metrics this crate emits (the edge of every server: nodes' API and
/// Raft ports, participants' ports).
#[rustfmt::skip]
pub const EDGE_METRICS: &[Described] = &[
    described("dtx_undecodable_requests_total", C, Unit::Count, "Requests refused before any handler because they could not be decoded, by server (api, raft, participant)."),
    described("dtx_rate_limited_total", C, Unit::Count, "Calls refused by the per-identity rate limit, by server."),
    described("dtx_auth_refusals_total", C, Unit::Count, "Calls refused before any handler ran, by server and code (unauthenticated, permission_denied)."),
    described("dtx_tls_handshake_failures_total", C, Unit::Count, "TLS handshakes that failed or took more than 10 s."),
    described("dtx_connections_refused_total", C, Unit::Count, "Connections closed before the server saw them, by reason (connections_max, connections_per_peer_max, anonymous_connections_max, no_http2_preface, not_http2)."),
    described("dtx_accept_errors_total", C, Unit::Count, "Failed accepts, by kind (too_many_open_files, other); each makes the accept loop wait (5 ms doubling to 1 s)."),
    described("dtx_tls_client_certificates_refused_total", C, Unit::Count, "Client certificates that prove no identity."),
    described("dtx_tls_reloads_total", C, Unit::Count, "Certificate files re-read after a change, by side (server, client)."),
    described("dtx_tls_reload_failures_total", C, Unit::Count, "Changed certificate files that could not be used, by side."),
];

/// Registers the HELP text and unit of every metric of `table` with the
/// installed recorder (call it after installing one: before, the
/// descriptions go nowhere).
pub fn describe(table: &[Described]) {
    for d in table {
        match d.kind {
            Kind::Counter => metrics::describe_counter!(d.name, d.unit, d.help),
            Kind::Gauge => metrics::describe_gauge!(d.name, d.unit, d.help),
            Kind::Histogram => metrics::describe_histogram!(d.name, d.unit, d.help),
        }
    }
}

/// One metric call found in a source file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Emitted {
    pub name: String,
    pub kind: Kind,
    pub file: String,
}

/// Every `counter!("dtx_…"`, `gauge!(…` and `histogram!(…` in the `.rs`
/// files under `dir` (for the crates' unit tests). `describe_counter!(`
/// and the like are not emissions; a name that is not a plain metric name
/// (a placeholder in a comment) is skipped.
pub fn emitted_in(dir: &Path) -> std::io::Result<Vec<Emitted>> {
    let mut out = Vec::new();
    scan(dir, &mut out)?;
    Ok(out)
}

fn scan(dir: &Path, out: &mut Vec<Emitted>) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            scan(&p, out)?;
            continue;
        }
        if p.extension().is_none_or(|x| x != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&p)?;
        for (mac, kind) in [
            ("counter!(", Kind::Counter),
            ("gauge!(", Kind::Gauge),
            ("histogram!(", Kind::Histogram),
        ] {
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
                let Some(end) = lit.find('"') else { continue };
                let name = &lit[..end];
                let plain = name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
                if name.starts_with("dtx_") && plain {
                    out.push(Emitted {
                        name: name.to_string(),
                        kind,
                        file: p.display().to_string(),
                    });
                }
            }
        }
    }
    Ok(())
}

/// What is wrong between the metrics `found` in a crate's sources and its
/// `table`: a metric without an entry, of another type, described twice,
/// or described and never emitted. Empty when they agree.
pub fn mismatches(found: &[Emitted], table: &[Described]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, d) in table.iter().enumerate() {
        if table[..i].iter().any(|e| e.name == d.name) {
            out.push(format!("{} is described twice", d.name));
        }
        if d.help.is_empty() {
            out.push(format!("{} has no HELP text", d.name));
        }
        if !found.iter().any(|f| f.name == d.name) {
            out.push(format!("{} is described but never emitted", d.name));
        }
    }
    for f in found {
        match table.iter().find(|d| d.name == f.name) {
            None => out.push(format!("{} ({}) has no entry (HELP text)", f.name, f.file)),
            Some(d) if d.kind != f.kind => out.push(format!(
                "{} ({}) is recorded as a {:?}, described as a {:?}",
                f.name, f.file, f.kind, d.kind
            )),
            Some(_) => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_edge_metric_is_described_and_every_description_is_emitted() {
        let found = emitted_in(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src")).unwrap();
        assert!(found.len() >= EDGE_METRICS.len(), "the scan found only {found:?}");
        let wrong = mismatches(&found, EDGE_METRICS);
        assert!(wrong.is_empty(), "{wrong:#?}");
    }

    #[test]
    fn mismatches_name_what_is_wrong() {
        let found = vec![
            Emitted {
                name: "dtx_a_total".into(),
                kind: Kind::Counter,
                file: "x.rs".into(),
            },
            Emitted {
                name: "dtx_b".into(),
                kind: Kind::Gauge,
                file: "y.rs".into(),
            },
        ];
        let table = [
            described("dtx_a_total", Kind::Gauge, Unit::Count, "a"),
            described("dtx_c", Kind::Gauge, Unit::Count, "c"),
            described("dtx_c", Kind::Gauge, Unit::Count, "c"),
        ];
        let wrong = mismatches(&found, &table);
        assert!(
            wrong
                .iter()
                .any(|w| w.contains("dtx_a_total (x.rs) is recorded as a Counter")),
            "{wrong:?}"
        );
        assert!(
            wrong.iter().any(|w| w.contains("dtx_b (y.rs) has no entry")),
            "{wrong:?}"
        );
        assert!(wrong.iter().any(|w| w == "dtx_c is described twice"), "{wrong:?}");
        assert!(
            wrong.iter().any(|w| w == "dtx_c is described but never emitted"),
            "{wrong:?}"
        );
    }
}
