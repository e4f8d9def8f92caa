//! How `coordinator admin` shows what the cluster answered: plain tables for
//! people, JSON (`--json`) for scripts. Pure functions of the answers and
//! the leader's clock, so the same record always reads the same way.

pub use dtx_client::view::outcome_name;
pub use dtx_client::view::reach_name;
pub use dtx_client::view::source_name;
pub use dtx_client::view::span;
pub use dtx_client::view::state_line;
pub use dtx_client::view::state_name;
pub use dtx_client::view::timeline;
pub use dtx_client::view::utc;
pub use dtx_client::view::waiting_on;
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
    let events = timeline(t, now_ms);
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
            dtx_client::view::phase_two(p, decided).to_string(),
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
            // Known only to a leader that has matched the member's log in
            // its term: null otherwise (never the whole log).
            "lag_entries": lag_known(s, m).then_some(m.lag_entries),
            "reach": reach_name(m.reach),
            "last_heard_ms_ago": m.last_heard_ms_ago,
        })).collect::<Vec<_>>(),
    })
}

/// Whether `s` (a node's answer) knows how far `m` lags: only a leader
/// knows, and only for a member whose log it has matched in its term (a
/// member paused or down since the leader was elected has matched index 0
/// there, and its lag is not known).
pub fn lag_known(s: &pb::ClusterStatusResponse, m: &pb::NodeStatus) -> bool {
    s.role == "Leader" && (m.node_id == s.node_id || m.matched_index > 0)
}

/// One member as `admin status` saw it: its own answer, or why none came.
pub struct MemberView<'a> {
    pub member: &'a pb::NodeStatus,
    pub own: Result<&'a pb::ClusterStatusResponse, String>,
}

/// `admin status`: the quorum line first, the addressed node's view, then
/// the leader's view of the members (reach, lag; `?` where not known)
/// beside each member's own answer (role, term, applied index, serving).
pub fn status_table(
    addressed: &pb::ClusterStatusResponse,
    leader: Option<&pb::ClusterStatusResponse>,
    quorum_line: &str,
    views: &[MemberView<'_>],
) -> String {
    let shown = leader.unwrap_or(addressed);
    let mut out = format!(
        "cluster {}  {quorum_line}\naddressed node {}: {}, term {}, {}; leader {}; next txid {}  transactions {}\n\n",
        addressed.cluster_id,
        addressed.node_id,
        addressed.role,
        addressed.term,
        if addressed.serving {
            "serving".to_string()
        } else {
            format!("NOT serving: {}", addressed.not_serving_reason)
        },
        match (addressed.leader_id, leader) {
            (0, _) => "none known".to_string(),
            (id, Some(_)) => id.to_string(),
            (id, None) => format!("{id} named, not answering as leader"),
        },
        shown.next_txid,
        shown.transactions,
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
        let lag = if lag_known(shown, m) {
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
    fn a_table_pads_every_column_but_the_last() {
        let mut t = Table::new(&["A", "BB", "C"]);
        t.row(vec!["xxx".into(), "y".into(), "last one".into()]);
        assert_eq!(t.render(), "A    BB  C\nxxx  y   last one");
    }
}
