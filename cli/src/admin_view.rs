//! How `coordinator admin` shows what the cluster answered: plain tables for
//! people, JSON (`--json`) for scripts. Pure functions of the answers and
//! the leader's clock, so the same record always reads the same way.

use dtx_proto::v1 as pb;
use serde_json::json;
use serde_json::Value;

/// A table: a header row and rows of cells, printed with columns padded to
/// their widest cell (the last column unpadded).
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let n = self.header.len();
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate().take(n) {
                widths[i] = widths[i].max(c.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (i, c) in cells.iter().enumerate().take(n) {
                if i + 1 == n {
                    s.push_str(c);
                } else {
                    s.push_str(c);
                    s.push_str(&" ".repeat(widths[i] - c.chars().count() + 2));
                }
            }
            s.trim_end().to_string()
        };
        let mut out = line(&self.header);
        for r in &self.rows {
            out.push('\n');
            out.push_str(&line(r));
        }
        out
    }
}

/// `2026-12-01T16:20:01.123Z` for milliseconds since the Unix epoch; `-`
/// for 0 (not set).
pub fn utc(ms: u64) -> String {
    if ms == 0 {
        return "-".into();
    }
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// Year, month, day of the day `days` after 1970-01-01 (the proleptic
/// Gregorian calendar; H. Hinnant's civil-from-days algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// A duration for people: `850ms`, `12.4s`, `5m10s`, `3h02m`, `2d04h`.
pub fn span(ms: u64) -> String {
    match ms {
        0..=999 => format!("{ms}ms"),
        1_000..=59_999 => format!("{:.1}s", ms as f64 / 1000.0),
        60_000..=3_599_999 => format!("{}m{:02}s", ms / 60_000, ms % 60_000 / 1000),
        3_600_000..=86_399_999 => format!("{}h{:02}m", ms / 3_600_000, ms % 3_600_000 / 60_000),
        _ => format!("{}d{:02}h", ms / 86_400_000, ms % 86_400_000 / 3_600_000),
    }
}

pub fn state_name(v: i32) -> &'static str {
    match pb::TxState::try_from(v) {
        Ok(pb::TxState::Active) => "ACTIVE",
        Ok(pb::TxState::Preparing) => "PREPARING",
        Ok(pb::TxState::Decided) => "DECIDED",
        _ => "UNSPECIFIED",
    }
}

pub fn outcome_name(v: i32) -> &'static str {
    match pb::Outcome::try_from(v) {
        Ok(pb::Outcome::Commit) => "COMMIT",
        Ok(pb::Outcome::Abort) => "ABORT",
        Ok(pb::Outcome::Pending) => "PENDING",
        Ok(pb::Outcome::UnknownPresumedAbort) => "UNKNOWN_PRESUMED_ABORT",
        _ => "UNSPECIFIED",
    }
}

pub fn source_name(v: i32) -> &'static str {
    match pb::DecisionSource::try_from(v) {
        Ok(pb::DecisionSource::Driver) => "driver",
        Ok(pb::DecisionSource::Client) => "client",
        Ok(pb::DecisionSource::Reaper) => "reaper",
        Ok(pb::DecisionSource::Operator) => "operator",
        _ => "unspecified",
    }
}

fn reach_name(v: i32) -> &'static str {
    match pb::MemberReach::try_from(v) {
        Ok(pb::MemberReach::Self_) => "self",
        Ok(pb::MemberReach::Reachable) => "reachable",
        Ok(pb::MemberReach::Unreachable) => "unreachable",
        _ => "unknown",
    }
}

/// Where one participant's phase two stands, in a word or two.
pub fn phase_two(p: &pb::ParticipantInfo, decided: bool) -> String {
    if p.acked {
        "acked".into()
    } else if p.dropped {
        "DROPPED: reconcile by hand".into()
    } else if decided {
        "waiting for ack".into()
    } else {
        "-".into()
    }
}

/// The participants a decided transaction still delivers to (not acked,
/// not dropped), or every participant of an undecided one (they may hold a
/// YES vote and wait).
pub fn waiting_on(t: &pb::StatusResponse) -> Vec<&pb::ParticipantInfo> {
    let decided = t.decision.is_some();
    t.participants
        .iter()
        .filter(|p| !p.acked && (!decided || !p.dropped))
        .collect()
}

pub fn participant_json(p: &pb::ParticipantInfo) -> Value {
    json!({
        "id": p.id,
        "address": p.address,
        "acked": p.acked,
        "delivery_attempts": p.delivery_attempts,
        "last_delivery_error": p.last_delivery_error,
        "next_delivery_unix_ms": p.next_delivery_unix_ms,
        "dropped": p.dropped,
        "dropped_note": p.dropped_note,
        "dropped_unix_ms": p.dropped_unix_ms,
    })
}

/// One transaction as JSON: the same field names as the API, states and
/// outcomes by name.
pub fn tx_json(t: &pb::StatusResponse) -> Value {
    json!({
        "txid": t.txid,
        "state": state_name(t.state),
        "begun_unix_ms": t.begun_unix_ms,
        "deadline_unix_ms": t.deadline_unix_ms,
        "one_phase": t.one_phase,
        "owner": t.owner,
        "decision": t.decision.as_ref().map(|d| json!({
            "outcome": outcome_name(d.outcome),
            "source": source_name(d.source),
            "term": d.term,
            "decided_unix_ms": d.decided_unix_ms,
            "note": d.note,
        })),
        "participants": t.participants.iter().map(participant_json).collect::<Vec<_>>(),
    })
}

/// A transaction's state with its outcome: `DECIDED COMMIT`, `PREPARING`.
pub fn state_line(t: &pb::StatusResponse) -> String {
    match &t.decision {
        Some(d) => format!("{} {}", state_name(t.state), outcome_name(d.outcome)),
        None => state_name(t.state).to_string(),
    }
}

/// The list table: one row per transaction.
pub fn tx_table(txs: &[pb::StatusResponse], now_ms: u64) -> String {
    let mut t = Table::new(&["TXID", "STATE", "AGE", "PARTICIPANTS", "WAITING ON", "NOTE"]);
    for x in txs {
        let waiting: Vec<String> = waiting_on(x)
            .iter()
            .map(|p| {
                if p.last_delivery_error.is_empty() {
                    p.id.clone()
                } else {
                    format!("{} ({} attempts)", p.id, p.delivery_attempts)
                }
            })
            .collect();
        let dropped: Vec<&str> = x
            .participants
            .iter()
            .filter(|p| p.dropped && !p.acked)
            .map(|p| p.id.as_str())
            .collect();
        let mut note = x.decision.as_ref().map(|d| d.note.clone()).unwrap_or_default();
        if !dropped.is_empty() {
            note = format!("DROPPED {} (reconcile by hand); {note}", dropped.join(","));
        }
        t.row(vec![
            x.txid.to_string(),
            state_line(x),
            span(now_ms.saturating_sub(x.begun_unix_ms)),
            format!(
                "{}/{} acked",
                x.participants.iter().filter(|p| p.acked).count(),
                x.participants.len()
            ),
            if waiting.is_empty() {
                "-".into()
            } else {
                waiting.join(", ")
            },
            note,
        ]);
    }
    t.render()
}

/// `show`: the transaction's timeline by the leader's clock, then where
/// each participant stands.
pub fn tx_timeline(t: &pb::StatusResponse, now_ms: u64) -> String {
    let mut out = format!("transaction {}  {}", t.txid, state_line(t));
    if t.one_phase {
        out.push_str("  (one-phase commit)");
    }
    if !t.owner.is_empty() {
        out.push_str(&format!("  owner {}", t.owner));
    }
    out.push_str("\n\ntimeline (the leader's clock, UTC)\n");
    let mut events: Vec<(u64, String)> = vec![(
        t.begun_unix_ms,
        format!(
            "begin (deadline {}, {} after begin)",
            utc(t.deadline_unix_ms),
            span(t.deadline_unix_ms.saturating_sub(t.begun_unix_ms))
        ),
    )];
    let ids: Vec<String> = t
        .participants
        .iter()
        .map(|p| format!("{} at {}", p.id, p.address))
        .collect();
    if !ids.is_empty() {
        events.push((t.begun_unix_ms, format!("enlisted {}", ids.join(", "))));
    }
    match &t.decision {
        Some(d) => {
            let votes = if outcome_name(d.outcome) == "COMMIT" {
                if t.one_phase {
                    "the one participant prepared and committed in one phase".to_string()
                } else {
                    format!(
                        "YES from every participant ({}): COMMIT needs them all",
                        t.participants
                            .iter()
                            .map(|p| p.id.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }
            } else {
                "not every participant voted YES in time, or the transaction was aborted before the votes (see the note)"
                    .to_string()
            };
            events.push((d.decided_unix_ms, format!("votes: {votes}")));
            events.push((
                d.decided_unix_ms,
                format!(
                    "decided {} by the {} in term {}: {}",
                    outcome_name(d.outcome),
                    source_name(d.source),
                    d.term,
                    if d.note.is_empty() { "-" } else { &d.note }
                ),
            ));
        }
        None => {
            if state_name(t.state) == "PREPARING" {
                events.push((now_ms, "preparing: votes are being collected (no decision yet)".into()));
            }
        }
    }
    for p in &t.participants {
        if p.dropped {
            events.push((
                p.dropped_unix_ms,
                format!("{} dropped from phase two: {}", p.id, p.dropped_note),
            ));
        }
    }
    events.sort_by_key(|e| e.0);
    let mut tl = Table::new(&["WHEN", "WHAT"]);
    for (when, what) in events {
        tl.row(vec![utc(when), what]);
    }
    out.push_str(&indent(&tl.render()));
    out.push_str("\n\nparticipants\n");
    let decided = t.decision.is_some();
    let mut pt = Table::new(&["ID", "ADDRESS", "PHASE TWO", "ATTEMPTS", "NEXT RETRY", "LAST ERROR"]);
    for p in &t.participants {
        pt.row(vec![
            p.id.clone(),
            p.address.clone(),
            phase_two(p, decided),
            if p.delivery_attempts == 0 {
                "-".into()
            } else {
                p.delivery_attempts.to_string()
            },
            if p.next_delivery_unix_ms == 0 {
                "-".into()
            } else {
                format!("in {}", span(p.next_delivery_unix_ms.saturating_sub(now_ms)))
            },
            if p.last_delivery_error.is_empty() {
                "-".into()
            } else {
                p.last_delivery_error.clone()
            },
        ]);
    }
    out.push_str(&indent(&pt.render()));
    out
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
}

/// The cluster as one node sees it, as JSON.
pub fn status_json(s: &pb::ClusterStatusResponse) -> Value {
    json!({
        "cluster_id": s.cluster_id,
        "node_id": s.node_id,
        "role": s.role,
        "serving": s.serving,
        "not_serving_reason": s.not_serving_reason,
        "leader_id": s.leader_id,
        "leader_api_addr": s.leader_api_addr,
        "term": s.term,
        "last_log_index": s.last_log_index,
        "last_applied_index": s.last_applied_index,
        "snapshot_index": s.snapshot_index,
        "purged_index": s.purged_index,
        "transactions": s.transactions,
        "next_txid": s.next_txid,
        "members": s.members.iter().map(|m| json!({
            "node_id": m.node_id,
            "raft_addr": m.raft_addr,
            "api_addr": m.api_addr,
            "voter": m.voter,
            "matched_index": m.matched_index,
            "lag_entries": m.lag_entries,
            "reach": reach_name(m.reach),
            "last_heard_ms_ago": m.last_heard_ms_ago,
        })).collect::<Vec<_>>(),
    })
}

/// One member as `admin status` saw it: its own answer, or why none came.
pub struct MemberView<'a> {
    pub member: &'a pb::NodeStatus,
    pub own: Result<&'a pb::ClusterStatusResponse, String>,
}

/// `admin status`: the leader's view of the members (reach, lag) beside
/// each member's own answer (role, term, applied index, serving).
pub fn status_table(leader_view: &pb::ClusterStatusResponse, views: &[MemberView<'_>]) -> String {
    let mut out = format!(
        "cluster {}  leader {}  term {}  next txid {}  transactions {}\n\n",
        leader_view.cluster_id,
        if leader_view.leader_id == 0 {
            "none known".to_string()
        } else {
            leader_view.leader_id.to_string()
        },
        leader_view.term,
        leader_view.next_txid,
        leader_view.transactions,
    );
    let mut t = Table::new(&[
        "NODE",
        "API ADDRESS",
        "KIND",
        "ROLE",
        "SERVING",
        "TERM",
        "APPLIED",
        "LAG",
        "REACH",
        "NOTE",
    ]);
    for v in views {
        let m = v.member;
        let kind = if m.voter { "voter" } else { "learner" };
        let lag = if leader_view.role == "Leader" {
            m.lag_entries.to_string()
        } else {
            "?".into()
        };
        let reach = match pb::MemberReach::try_from(m.reach) {
            Ok(pb::MemberReach::Reachable) | Ok(pb::MemberReach::Unreachable) => {
                format!("{} ({} ago)", reach_name(m.reach), span(m.last_heard_ms_ago))
            }
            _ => reach_name(m.reach).to_string(),
        };
        match &v.own {
            Ok(s) => t.row(vec![
                m.node_id.to_string(),
                m.api_addr.clone(),
                kind.into(),
                s.role.clone(),
                if s.serving { "yes".into() } else { "NO".into() },
                s.term.to_string(),
                s.last_applied_index.to_string(),
                lag,
                reach,
                s.not_serving_reason.clone(),
            ]),
            Err(e) => t.row(vec![
                m.node_id.to_string(),
                m.api_addr.clone(),
                kind.into(),
                "?".into(),
                "NO ANSWER".into(),
                "?".into(),
                "?".into(),
                lag,
                reach,
                e.clone(),
            ]),
        }
    }
    out.push_str(&t.render());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formats_known_instants() {
        assert_eq!(utc(0), "-");
        assert_eq!(utc(1), "1970-01-01T00:00:00.001Z");
        assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(utc(1_764_606_001_123), "2025-12-01T16:20:01.123Z");
    }

    #[test]
    fn spans_read_as_people_write_them() {
        assert_eq!(span(850), "850ms");
        assert_eq!(span(12_400), "12.4s");
        assert_eq!(span(310_000), "5m10s");
        assert_eq!(span(3 * 3_600_000 + 120_000), "3h02m");
        assert_eq!(span(2 * 86_400_000 + 4 * 3_600_000), "2d04h");
    }

    #[test]
    fn a_table_pads_every_column_but_the_last() {
        let mut t = Table::new(&["A", "BB", "C"]);
        t.row(vec!["xxx".into(), "y".into(), "last one".into()]);
        assert_eq!(t.render(), "A    BB  C\nxxx  y   last one");
    }

    #[test]
    fn a_dropped_participant_is_not_waited_on_once_decided() {
        let p = |id: &str, acked: bool, dropped: bool| pb::ParticipantInfo {
            id: id.into(),
            acked,
            dropped,
            ..Default::default()
        };
        let mut t = pb::StatusResponse {
            txid: 7,
            state: pb::TxState::Decided as i32,
            participants: vec![p("a", true, false), p("b", false, false), p("c", false, true)],
            decision: Some(pb::Decision {
                outcome: pb::Outcome::Abort as i32,
                ..Default::default()
            }),
            ..Default::default()
        };
        let ids: Vec<&str> = waiting_on(&t).iter().map(|p| p.id.as_str()).collect();
        assert_eq!(ids, ["b"]);
        t.decision = None;
        let ids: Vec<&str> = waiting_on(&t).iter().map(|p| p.id.as_str()).collect();
        assert_eq!(ids, ["b", "c"]);
    }
}
