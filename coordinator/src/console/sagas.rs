//! The console's saga pages: `/console/sagas?state=` (a page of sagas by id,
//! filtered by state) and `/console/saga/<id>` (one saga's journal: each
//! step's forward call and compensation, residuals, the operator's actions),
//! in the words of `admin saga list` / `show`. Pure renderers of the API's
//! `pb::SagaView`; everything from data goes through [`esc`].

use std::fmt::Write as _;

use dtx_common::view::span;
use dtx_common::view::utc;
use dtx_proto::v1 as pb;

use super::html::esc;
use super::html::page;
use super::html::pct_decode;
use super::html::Frame;
use crate::sm::saga::SagaBook;
use crate::sm::saga::SagaState;

/// Sagas per page of `/console/sagas`.
pub const PAGE_SAGAS: usize = 100;

/// The states a saga list may be filtered by, with their query words.
pub const STATES: [(&str, SagaState); 5] = [
    ("running", SagaState::Running),
    ("compensating", SagaState::Compensating),
    ("completed", SagaState::Completed),
    ("compensated", SagaState::Compensated),
    ("parked", SagaState::Parked),
];

/// The query of `/console/sagas`: `state=` (one of [`STATES`]) and
/// `after=` (a saga id); anything else is refused with its name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SagaQuery {
    pub state: Option<SagaState>,
    pub after: u64,
}

impl SagaQuery {
    pub fn url(&self) -> String {
        let mut parts = Vec::new();
        if let Some(s) = self.state {
            parts.push(format!("state={}", word(s)));
        }
        if self.after > 0 {
            parts.push(format!("after={}", self.after));
        }
        if parts.is_empty() {
            "/console/sagas".into()
        } else {
            format!("/console/sagas?{}", parts.join("&"))
        }
    }
}

fn word(s: SagaState) -> &'static str {
    STATES.iter().find(|(_, st)| *st == s).map(|(w, _)| *w).unwrap_or("?")
}

pub fn parse_query(query: &str) -> Result<SagaQuery, String> {
    let mut q = SagaQuery::default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "state" if v.is_empty() => q.state = None,
            "state" => {
                q.state = Some(STATES.iter().find(|(w, _)| *w == v).map(|(_, s)| *s).ok_or_else(|| {
                    format!(
                        "state={:?} is not one of running, compensating, completed, compensated, parked",
                        pct_decode(v).unwrap_or_else(|_| v.to_string())
                    )
                })?)
            }
            "after" => {
                q.after = v
                    .parse()
                    .map_err(|_| format!("after={v:?} is not a saga id (a whole number)"))?
            }
            other => {
                return Err(format!(
                    "{:?} is not a filter of the saga list (state, after)",
                    pct_decode(other).unwrap_or_else(|_| other.to_string())
                ))
            }
        }
    }
    Ok(q)
}

/// One page of sagas for `q` from the book, with their definitions, and
/// the id to go on after (0: none).
pub fn list_page(book: &SagaBook, q: &SagaQuery) -> (Vec<pb::SagaView>, u64) {
    let (page, next) = book.list(q.after, PAGE_SAGAS, |s| q.state.is_none_or(|st| st == s.state));
    let views = page.into_iter().map(|s| crate::api::saga::view_pb(s, book)).collect();
    (views, next)
}

/// Counts by state, for the overview.
pub fn counts(book: &SagaBook) -> Vec<(&'static str, usize, String)> {
    STATES
        .iter()
        .map(|(_, s)| {
            (
                s.name(),
                book.count_in(*s),
                SagaQuery {
                    state: Some(*s),
                    after: 0,
                }
                .url(),
            )
        })
        .collect()
}

fn state_name(v: i32) -> &'static str {
    dtx_proto::names::saga_state(v).unwrap_or("?")
}

fn outcome_name(v: i32) -> &'static str {
    dtx_proto::names::step_outcome(v).unwrap_or("-")
}

fn kind_name(v: i32) -> &'static str {
    dtx_proto::names::step_kind(v).unwrap_or("?")
}

fn badge(v: &pb::SagaView) -> String {
    let name = state_name(v.state);
    let class = match name {
        "COMPLETED" => "s-commit",
        "COMPENSATED" => "s-abort",
        "PARKED" => "bad",
        _ => "s-preparing",
    };
    let mut text = name.to_string();
    if name == "PARKED" {
        let _ = write!(text, " (from {})", state_name(v.parked_from));
    }
    format!("<span class=\"s {class}\">{}</span>", esc(&text))
}

fn saga_link(id: u64) -> String {
    format!("<a href=\"/console/saga/{id}\">{id}</a>")
}

fn step_label(v: &pb::SagaView) -> String {
    if matches!(state_name(v.state), "COMPLETED" | "COMPENSATED") {
        return "-".into();
    }
    match v.steps.get(v.current_step as usize) {
        Some(s) => format!("{} {}", v.current_step, s.name),
        None => v.current_step.to_string(),
    }
}

/// `/console/sagas`.
pub fn render_list(f: &Frame, q: &SagaQuery, rows: &[pb::SagaView], next_after: u64) -> String {
    let mut b = String::new();
    b.push_str("<p id=\"filters\">State: ");
    let all = SagaQuery { state: None, after: 0 };
    let _ = write!(b, "<a href=\"{}\">all</a>", esc(&all.url()));
    for (w, s) in STATES {
        let u = SagaQuery {
            state: Some(s),
            after: 0,
        }
        .url();
        if q.state == Some(s) {
            let _ = write!(b, " · <b>{w}</b>");
        } else {
            let _ = write!(b, " · <a href=\"{}\">{w}</a>", esc(&u));
        }
    }
    b.push_str("</p>");
    if rows.is_empty() {
        b.push_str("<p id=\"empty\">No saga matches.</p>");
    } else {
        b.push_str(
            "<table id=\"sagas\"><tr><th>ID</th><th>DEFINITION</th><th>STATE</th><th>STEP</th><th>STARTED</th>\
             <th>PARKED REASON</th></tr>",
        );
        for v in rows {
            let _ = write!(
                b,
                "<tr><td>{}</td><td class=\"mono\">{}@{}</td><td>{}</td><td>{}</td><td class=\"mono\">{}</td><td>{}</td></tr>",
                saga_link(v.saga_id),
                esc(&v.definition),
                v.version,
                badge(v),
                esc(&step_label(v)),
                utc(v.started_at_ms),
                esc(&v.parked_reason),
            );
        }
        b.push_str("</table>");
    }
    if next_after != 0 {
        let next = SagaQuery {
            state: q.state,
            after: next_after,
        };
        let _ = write!(b, "<p><a id=\"next\" href=\"{}\">next page</a></p>", esc(&next.url()));
    }
    b.push_str(
        "<p class=\"muted\">A PARKED saga waits for an operator: <span class=\"mono\">coordinator admin saga \
         retry|skip|compensate|complete ID --why ...</span> (the console changes nothing).</p>",
    );
    page(f, "Sagas", true, &b)
}

fn call_cells(c: Option<&pb::StepCallView>, now_ms: u64) -> String {
    let Some(c) = c else {
        return "<td class=\"muted\">-</td>".into();
    };
    let mut s = format!(
        "<span class=\"mono\">{}</span> <b>{}</b> · {} attempt{}",
        esc(&c.operation_id),
        outcome_name(c.outcome),
        c.attempts,
        if c.attempts == 1 { "" } else { "s" }
    );
    if c.unknown_since_ms != 0 {
        let _ = write!(
            s,
            " · <span class=\"warn\">UNKNOWN for {}</span>",
            span(now_ms.saturating_sub(c.unknown_since_ms))
        );
    }
    if c.unknown_ms != 0 {
        let _ = write!(s, " · was UNKNOWN {}", span(c.unknown_ms));
    }
    if c.reconciliations != 0 {
        let _ = write!(s, " · {} reconciled", c.reconciliations);
    }
    if !c.resource_version.is_empty() {
        let _ = write!(s, " · version <span class=\"mono\">{}</span>", esc(&c.resource_version));
    }
    if !c.reason.is_empty() {
        let _ = write!(s, "<br><span class=\"muted\">{}</span>", esc(&c.reason));
    }
    format!("<td>{s}</td>")
}

/// `/console/saga/<id>`.
pub fn render_saga(f: &Frame, v: &pb::SagaView) -> String {
    let mut b = String::new();
    let _ = write!(b, "<p id=\"state\">{}", badge(v));
    if v.past_pivot {
        b.push_str(" · past its pivot (only forward)");
    }
    b.push_str("</p>");
    if !v.parked_reason.is_empty() {
        let _ = write!(b, "<p id=\"parked\" class=\"bad\">{}</p>", esc(&v.parked_reason));
    }
    if !v.cancel_reason.is_empty() {
        let _ = write!(b, "<p id=\"stopped\">stopped: {}</p>", esc(&v.cancel_reason));
    }
    b.push_str("<table id=\"saga\">");
    let auth = v.authorization.clone().unwrap_or_default();
    let expiry = if auth.expires_at_ms == 0 {
        "never".to_string()
    } else {
        utc(auth.expires_at_ms)
    };
    for (k, val) in [
        ("definition", format!("{}@{}", esc(&v.definition), v.version)),
        ("idempotency key", esc(&v.idempotency_key)),
        ("started", utc(v.started_at_ms)),
        (
            "deadline",
            if v.deadline_at_ms == 0 {
                "-".into()
            } else {
                utc(v.deadline_at_ms)
            },
        ),
        (
            "ended",
            if v.ended_at_ms == 0 {
                "-".into()
            } else {
                utc(v.ended_at_ms)
            },
        ),
        (
            "authorization",
            format!(
                "principal {} · tenant {} · policy {} · expires {}",
                esc(&auth.principal),
                esc(&auth.tenant),
                esc(&auth.policy),
                expiry
            ),
        ),
        ("owner", if v.owner.is_empty() { "-".into() } else { esc(&v.owner) }),
        ("journal writes", v.journal_seq.to_string()),
        ("status queries failed in a row", v.query_failures.to_string()),
    ] {
        let _ = write!(b, "<tr><th>{k}</th><td>{val}</td></tr>");
    }
    b.push_str("</table>");
    b.push_str(
        "<h2>Steps</h2><table id=\"steps\"><tr><th>STEP</th><th>KIND</th><th>FORWARD</th><th>COMPENSATION</th>\
         <th>RESIDUAL</th></tr>",
    );
    for s in &v.steps {
        let here = s.step == v.current_step && !matches!(state_name(v.state), "COMPLETED" | "COMPENSATED");
        let _ = write!(
            b,
            "<tr><td>{}{} {}</td><td>{}</td>{}{}<td>{}</td></tr>",
            if here { "▶ " } else { "" },
            s.step,
            esc(&s.name),
            kind_name(s.kind),
            call_cells(s.forward.as_ref(), f.now_ms),
            call_cells(s.compensation.as_ref(), f.now_ms),
            if s.residual.is_empty() {
                "-".into()
            } else {
                esc(&s.residual)
            },
        );
    }
    b.push_str("</table>");
    if !v.operator_actions.is_empty() {
        b.push_str(
            "<h2>Operator actions</h2><table id=\"operator-actions\"><tr><th>WHEN</th><th>WHO</th><th>ACTION</th>\
             <th>STEP</th><th>WHY</th></tr>",
        );
        for a in &v.operator_actions {
            let _ = write!(
                b,
                "<tr><td class=\"mono\">{}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td><td>{}</td></tr>",
                utc(a.at_ms),
                esc(&a.who),
                esc(&a.action),
                a.step,
                esc(&a.why)
            );
        }
        b.push_str("</table>");
    }
    page(f, &format!("Saga {}", v.saga_id), true, &b)
}

/// The 404 page of `/console/saga/<id>`.
pub fn render_not_found(f: &Frame, id: u64) -> String {
    let b = format!(
        "<p id=\"not-found\">saga {id} not found: never started here, or forgotten after its retention \
         (saga.retention_ms).</p><p class=\"muted\">This page shows this node's applied state: a saga started a \
         moment ago may not be applied here yet.</p>"
    );
    page(f, &format!("Saga {id}"), false, &b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sm::saga::Authorization;
    use crate::sm::saga::Definition;
    use crate::sm::saga::JournalEvent;
    use crate::sm::saga::Recovery;
    use crate::sm::saga::Reply;
    use crate::sm::saga::RetryPolicy;
    use crate::sm::saga::SagaCommand;
    use crate::sm::saga::StepDef;
    use crate::sm::saga::StepKind;

    const EVIL: &str = "<script>alert(\"x\")</script>'&";

    fn frame() -> Frame {
        Frame {
            cluster_id: "dtx-test".into(),
            node_id: 1,
            role: "Leader".into(),
            term: 3,
            applied_index: 42,
            serving: true,
            leader_id: 1,
            leader_api_addr: "127.0.0.1:7201".into(),
            leader_console: Some("/console".into()),
            now_ms: 10_000,
        }
    }

    fn step(name: &str, kind: StepKind) -> StepDef {
        StepDef {
            name: name.into(),
            kind,
            service: "127.0.0.1:1".into(),
            action: "a".into(),
            compensation: (kind == StepKind::Compensable).then(|| "undo".to_string()),
            status_query: "q".into(),
            versioned: true,
            retry: RetryPolicy::default(),
            on_failure: if kind == StepKind::Pivot {
                vec![Recovery::Park]
            } else {
                Vec::new()
            },
            high_impact: false,
            completion_timeout_ms: 0,
        }
    }

    /// Saga 1 COMPLETED, saga 2 PARKED at its pivot with `reason`.
    fn book(reason: &str) -> SagaBook {
        let d = Definition {
            name: "order".into(),
            version: 1,
            steps: vec![step("reserve", StepKind::Compensable), step("charge", StepKind::Pivot)],
        };
        let mut b = SagaBook::default();
        let mut fx = Vec::new();
        let mut apply = |b: &mut SagaBook, c: SagaCommand| b.apply(&c, &mut fx).unwrap();
        apply(&mut b, SagaCommand::Register { definition: d });
        for key in ["k1", "k2"] {
            apply(
                &mut b,
                SagaCommand::Start {
                    idempotency_key: key.into(),
                    fingerprint: [0; 32],
                    definition: "order".into(),
                    version: 1,
                    input: b"{}".to_vec(),
                    authorization: Authorization {
                        principal: EVIL.into(),
                        ..Authorization::default()
                    },
                    owner: None,
                    now_ms: 1_000,
                    deadline_ms: 0,
                },
            );
        }
        let mut write = |b: &mut SagaBook, id: u64, event: JournalEvent| {
            let seq = b.get(id).unwrap().seq;
            apply(
                b,
                SagaCommand::Journal {
                    saga_id: id,
                    seq,
                    now_ms: 2_000,
                    event,
                },
            );
        };
        for id in [1, 2] {
            write(&mut b, id, JournalEvent::ForwardIntent { step: 0 });
            write(
                &mut b,
                id,
                JournalEvent::ForwardOutcome {
                    step: 0,
                    reply: Reply {
                        resource_version: "7".into(),
                        ..Reply::of(crate::sm::saga::CallOutcome::Ok, "")
                    },
                },
            );
            write(&mut b, id, JournalEvent::ForwardIntent { step: 1 });
        }
        write(
            &mut b,
            1,
            JournalEvent::ForwardOutcome {
                step: 1,
                reply: Reply::of(crate::sm::saga::CallOutcome::Ok, ""),
            },
        );
        write(
            &mut b,
            2,
            JournalEvent::ForwardOutcome {
                step: 1,
                reply: Reply::of(crate::sm::saga::CallOutcome::Failed, reason),
            },
        );
        write(
            &mut b,
            2,
            JournalEvent::Recover {
                step: 1,
                option: Recovery::Park,
                reason: reason.into(),
            },
        );
        b
    }

    #[test]
    fn saga_queries_parse_strictly_and_round_trip() {
        assert_eq!(parse_query("").unwrap(), SagaQuery::default());
        let q = parse_query("state=parked&after=17").unwrap();
        assert_eq!(
            q,
            SagaQuery {
                state: Some(SagaState::Parked),
                after: 17
            }
        );
        assert_eq!(parse_query(&q.url()["/console/sagas?".len()..]).unwrap(), q);
        assert!(parse_query("state=parkd").unwrap_err().contains("\"parkd\""));
        assert!(parse_query("after=x").unwrap_err().contains("saga id"));
        assert!(parse_query("sate=parked").unwrap_err().contains("\"sate\""));
    }

    #[test]
    fn routes_reach_the_saga_pages() {
        use super::super::route;
        use super::super::Route;
        assert_eq!(route("GET", "/console/sagas", true), Route::Sagas(SagaQuery::default()));
        assert_eq!(route("GET", "/console/saga/7", true), Route::Saga(7));
        assert!(matches!(route("GET", "/console/saga/x", true), Route::BadRequest(m) if m.contains("saga id")));
        assert!(matches!(
            route("GET", "/console/sagas?state=nope", true),
            Route::BadRequest(_)
        ));
        assert_eq!(route("POST", "/console/saga/7", true), Route::MethodNotAllowed);
    }

    #[test]
    fn the_list_filters_by_state_and_shows_the_parked_reason() {
        let b = book("insufficient funds");
        let (rows, next) = list_page(&b, &parse_query("state=parked").unwrap());
        assert_eq!((rows.len(), next), (1, 0));
        let html = render_list(&frame(), &parse_query("state=parked").unwrap(), &rows, next);
        assert!(html.contains("<a href=\"/console/saga/2\">2</a>"), "{html}");
        assert!(html.contains("PARKED (from RUNNING)"), "{html}");
        assert!(html.contains("insufficient funds"), "{html}");
        assert!(html.contains("1 charge"), "the step it parked at: {html}");
        assert!(!html.contains("/console/saga/1\""), "a COMPLETED saga is not PARKED");
        let (all, _) = list_page(&b, &SagaQuery::default());
        assert_eq!(all.len(), 2);
        let c = counts(&b);
        assert!(
            c.contains(&("PARKED", 1, "/console/sagas?state=parked".to_string())),
            "{c:?}"
        );
        assert!(
            c.contains(&("COMPLETED", 1, "/console/sagas?state=completed".to_string())),
            "{c:?}"
        );
    }

    #[test]
    fn a_saga_page_shows_its_journal_and_escapes_every_datum() {
        let b = book(EVIL);
        let r = b.get(2).unwrap();
        let v = crate::api::saga::view_pb(r, &b);
        let html = render_saga(&frame(), &v);
        assert!(!html.contains("<script>"), "{html}");
        assert!(html.contains("&lt;script&gt;"), "{html}");
        for want in [
            "2.0.f1",
            "2.1.f1",
            "COMPENSABLE",
            "PIVOT",
            "FAILED",
            "version <span class=\"mono\">7</span>",
            "▶ 1 charge",
        ] {
            assert!(html.contains(want), "{want:?} missing: {html}");
        }
        assert!(!html.contains("id=\"stopped\""), "not cancelled: {html}");
        let html = render_not_found(&frame(), 99);
        assert!(html.contains("saga 99 not found"), "{html}");
    }

    #[test]
    fn a_cancelled_saga_page_says_why_it_stopped_escaped() {
        let b = book(EVIL);
        let mut v = crate::api::saga::view_pb(b.get(2).unwrap(), &b);
        v.cancel_reason = format!("cancelled by shop: {EVIL}");
        v.deadline_at_ms = 1_700_000_000_000;
        let html = render_saga(&frame(), &v);
        assert!(!html.contains("<script>"), "{html}");
        assert!(
            html.contains("<p id=\"stopped\">stopped: cancelled by shop: &lt;script&gt;"),
            "{html}"
        );
        assert!(html.contains(&utc(1_700_000_000_000)), "the deadline: {html}");
    }
}
