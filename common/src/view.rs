//! How operators read a transaction, in words shared by every tool that
//! shows one (`coordinator admin`, the nodes' web console): times, spans,
//! the names of states, outcomes and sources, and where each participant's
//! phase two stands. Pure functions of the API's messages.

use dtx_proto::v1 as pb;

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

/// Year, month, day of the day `days` after 1970-01-01 (H. Hinnant's
/// civil-from-days).
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

/// A `TxState` by name: ACTIVE, PREPARING, DECIDED.
pub fn state_name(v: i32) -> &'static str {
    match pb::TxState::try_from(v) {
        Ok(pb::TxState::Active) => "ACTIVE",
        Ok(pb::TxState::Preparing) => "PREPARING",
        Ok(pb::TxState::Decided) => "DECIDED",
        _ => "UNSPECIFIED",
    }
}

/// An `Outcome` by name: COMMIT, ABORT, PENDING, UNKNOWN_PRESUMED_ABORT.
pub fn outcome_name(v: i32) -> &'static str {
    match pb::Outcome::try_from(v) {
        Ok(pb::Outcome::Commit) => "COMMIT",
        Ok(pb::Outcome::Abort) => "ABORT",
        Ok(pb::Outcome::Pending) => "PENDING",
        Ok(pb::Outcome::UnknownPresumedAbort) => "UNKNOWN_PRESUMED_ABORT",
        _ => "UNSPECIFIED",
    }
}

/// A `DecisionSource` by name: driver, client, reaper, operator.
pub fn source_name(v: i32) -> &'static str {
    match pb::DecisionSource::try_from(v) {
        Ok(pb::DecisionSource::Driver) => "driver",
        Ok(pb::DecisionSource::Client) => "client",
        Ok(pb::DecisionSource::Reaper) => "reaper",
        Ok(pb::DecisionSource::Operator) => "operator",
        Ok(pb::DecisionSource::OperatorHeuristic) => "operator-heuristic",
        _ => "unspecified",
    }
}

/// A `MemberReach` by name: self, reachable, unreachable, unknown.
pub fn reach_name(v: i32) -> &'static str {
    match pb::MemberReach::try_from(v) {
        Ok(pb::MemberReach::Self_) => "self",
        Ok(pb::MemberReach::Reachable) => "reachable",
        Ok(pb::MemberReach::Unreachable) => "unreachable",
        _ => "unknown",
    }
}

/// A transaction's state with its outcome: `DECIDED COMMIT`, `PREPARING`.
pub fn state_line(t: &pb::StatusResponse) -> String {
    match &t.decision {
        Some(d) => format!("{} {}", state_name(t.state), outcome_name(d.outcome)),
        None => state_name(t.state).to_string(),
    }
}

/// Where one participant's phase two stands, in `admin txn show`'s words.
pub fn phase_two(p: &pb::ParticipantInfo, decided: bool) -> &'static str {
    if p.acked {
        "acked"
    } else if p.dropped {
        "DROPPED: reconcile by hand"
    } else if decided {
        "waiting for ack"
    } else {
        "-"
    }
}

/// The participants a decided transaction still delivers to (not acked,
/// not dropped), or every unacked participant of an undecided one (they
/// may hold a YES vote and wait).
pub fn waiting_on(t: &pb::StatusResponse) -> Vec<&pb::ParticipantInfo> {
    let decided = t.decision.is_some();
    t.participants
        .iter()
        .filter(|p| !p.acked && (!decided || !p.dropped))
        .collect()
}

/// The timeline events of `t` (`admin txn show`'s), by time.
pub fn timeline(t: &pb::StatusResponse, now_ms: u64) -> Vec<(u64, String)> {
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
            let heuristic = d.source == pb::DecisionSource::OperatorHeuristic as i32;
            let votes = if heuristic {
                "none: the participant never answered; an operator declared it lost and chose the outcome \
                 (it may have done otherwise)"
                    .to_string()
            } else if outcome_name(d.outcome) == "COMMIT" {
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
                // Who voted what is in the driver's note (each participant's
                // vote, or why none came); the other sources decide without
                // a count of votes.
                match source_name(d.source) {
                    "driver" => d.note.clone(),
                    "client" => "none counted: the client aborted it".to_string(),
                    "reaper" => "none counted: its deadline passed without a decision".to_string(),
                    "operator" => "none counted: an operator aborted it".to_string(),
                    _ => "see the note".to_string(),
                }
            };
            events.push((d.decided_unix_ms, format!("votes: {votes}")));
            events.push((
                d.decided_unix_ms,
                format!(
                    "decided {} by the {} in term {}: {}",
                    outcome_name(d.outcome),
                    if heuristic {
                        "operator, heuristically (not the participant's answer)"
                    } else {
                        source_name(d.source)
                    },
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
    events
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
