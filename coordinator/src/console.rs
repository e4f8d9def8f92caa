//! The read-only web console on the node's HTTP port (`metrics_addr`):
//! server-rendered HTML, no scripts, no forms, no external assets. Pages,
//! all GET (anything else answers 405):
//!
//! - `/console`: this node (role, serving, term, applied index), the
//!   leader, the members with reach and lag as `ClusterStatus` gives them,
//!   and the transactions counted by state.
//! - `/console/transactions?state=&unacknowledged=1&dropped=1&participant=&after=`:
//!   a page of [`PAGE_RECORDS`] transactions by txid, filtered by the same
//!   `TxTable::list` as `ListTransactions`.
//! - `/console/in-doubt`: PREPARING and decided-unacknowledged
//!   transactions, oldest first, with the participants still waiting.
//! - `/console/txn/<txid>`: one transaction's timeline and each
//!   participant's phase two, in the words of `admin txn show`.
//! - `/console/sagas?state=&after=` and `/console/saga/<id>`: sagas by
//!   state, and one saga's journal (`sagas`).
//!
//! Every page shows THIS node's applied state (no linearizable read: a
//! follower may lag the leader by a few entries) and says so. The port has
//! no authentication: the pages show transaction and participant ids,
//! addresses and notes, so `metrics_addr` belongs on a management network;
//! `console_enabled = false` turns the console off (404).
//!
//! The renderers are pure functions of plain data (the API's
//! `pb::StatusResponse` and `pb::ClusterStatusResponse`), and everything
//! that comes from data goes through [`esc`].

use std::fmt::Write as _;
use std::sync::Arc;

use dtx_proto::v1 as pb;
use dtx_proto::v1::admin_server::Admin;

use crate::api::admin::AdminService;
use crate::api::coordinator::add_delivery_attempts;
use crate::api::coordinator::status_pb;
use crate::api::coordinator::Audience;
use crate::ctx::now_ms;
use crate::driver::Driver;
use crate::limits;
use crate::raft::serving::Monitor;
use crate::sm::operator::ListFilter;
use crate::sm::operator::StateFilter;
use crate::sm::Phase;
use crate::sm::TxTable;
use crate::store::retained::RetainedReadError;
use crate::store::sm_store::SmState;

mod html;
mod sagas;

pub use html::esc;
use html::page;
pub use html::pct;
pub use html::pct_decode;
pub use html::Frame;

/// Transactions per page of `/console/transactions`.
pub const PAGE_RECORDS: usize = 100;

/// The most PREPARING and the most unacknowledged transactions (each) the
/// in-doubt page gathers, lowest txids (the oldest) first.
pub const IN_DOUBT_MAX: usize = 1000;

pub const HTML: &str = "text/html; charset=utf-8";
pub const TEXT: &str = "text/plain; charset=utf-8";

/// Headers on every console answer: no scripts, frames, forms or caching
/// (the pages have none and need none).
pub const HEADERS: [(&str, &str); 4] = [
    (
        "content-security-policy",
        "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'; form-action 'none'; base-uri 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("cache-control", "no-store"),
    ("referrer-policy", "no-referrer"),
];

/// An answer: HTTP status, content type, body.
pub type Reply = (u16, &'static str, String);

/// The console's answer to `method` `path_and_query`, or None when the path
/// is not the console's (the metrics port serves it as before).
pub async fn handle(method: &str, path_and_query: &str, driver: &Arc<Driver>, monitor: &Monitor) -> Option<Reply> {
    let route = route(method, path_and_query, driver.ctx.config.console_enabled);
    let page = match route {
        Route::NotConsole => return None,
        Route::Disabled => {
            return Some((
                404,
                TEXT,
                "not found: the console is turned off on this node (console_enabled = false)\n".into(),
            ))
        }
        Route::MethodNotAllowed => {
            return Some((
                405,
                TEXT,
                "method not allowed: the console is read-only (GET only)\n".into(),
            ))
        }
        other => other,
    };
    let status = cluster_status(driver, monitor).await;
    let frame = Frame::of(&status, now_ms());
    let ctx = &driver.ctx;
    Some(match page {
        Route::Overview => {
            let (counts, saga_counts) = {
                let st = ctx.sm.state();
                (
                    Counts::of(&st.table).with_retained(st.retained_count),
                    sagas::counts(&st.sagas),
                )
            };
            (200, HTML, render_overview(&frame, &status, &counts, &saga_counts))
        }
        Route::Transactions(q) => {
            let page = list_page(&ctx.sm.state(), &q);
            match page {
                Ok((mut rows, next_after)) => {
                    attempts(driver, &frame, &mut rows).await;
                    (200, HTML, render_transactions(&frame, &q, &rows, next_after))
                }
                Err(e) => (503, HTML, render_unreadable(&frame, &e.to_string())),
            }
        }
        Route::InDoubt => {
            let (mut rows, cut) = {
                let st = ctx.sm.state();
                in_doubt(&st.table)
            };
            attempts(driver, &frame, &mut rows).await;
            (200, HTML, render_in_doubt(&frame, &rows, cut))
        }
        Route::Txn(txid) => {
            let found = ctx.sm.state().with_txid(txid, |t| t.get(txid).map(|r| status_pb(t, r)));
            match found {
                Err(e) => (503, HTML, render_unreadable(&frame, &e.to_string())),
                Ok(None) => (404, HTML, render_txn_not_found(&frame, txid)),
                Ok(Some(mut t)) => {
                    attempts(driver, &frame, std::slice::from_mut(&mut t)).await;
                    (200, HTML, render_txn(&frame, &t))
                }
            }
        }
        Route::Sagas(q) => {
            let (rows, next_after) = sagas::list_page(&ctx.sm.state().sagas, &q);
            (200, HTML, sagas::render_list(&frame, &q, &rows, next_after))
        }
        Route::Saga(id) => {
            let found = {
                let st = ctx.sm.state();
                st.sagas.get(id).map(|r| crate::api::saga::view_pb(r, &st.sagas))
            };
            match found {
                Some(v) => (200, HTML, sagas::render_saga(&frame, &v)),
                None => (404, HTML, sagas::render_not_found(&frame, id)),
            }
        }
        Route::BadRequest(why) => (400, HTML, render_error(&frame, 400, &why)),
        Route::NotFound => (
            404,
            HTML,
            render_error(
                &frame,
                404,
                "no such page: the console has /console, /console/transactions, /console/in-doubt, /console/txn/TXID, \
                 /console/sagas and /console/saga/ID",
            ),
        ),
        Route::NotConsole | Route::Disabled | Route::MethodNotAllowed => unreachable!("answered above"),
    })
}

/// The leader's delivery attempts (leader-local, not replicated) on the
/// participants of `rows`; a node that does not lead shows none, and says so.
async fn attempts(driver: &Driver, frame: &Frame, rows: &mut [pb::StatusResponse]) {
    if frame.leads() {
        add_delivery_attempts(driver, rows, Audience::Operator).await;
    }
}

/// This node's `ClusterStatus`, exactly as the Admin API answers it.
async fn cluster_status(driver: &Arc<Driver>, monitor: &Monitor) -> pb::ClusterStatusResponse {
    let svc = AdminService::new(driver.clone());
    let mut req = tonic::Request::new(pb::ClusterStatusRequest {});
    req.extensions_mut().insert(monitor.clone());
    match Admin::cluster_status(&svc, req).await {
        Ok(r) => r.into_inner(),
        // It does not fail today; if it ever does, the page still renders.
        Err(e) => pb::ClusterStatusResponse {
            node_id: driver.ctx.id,
            cluster_id: driver.ctx.config.cluster_id.clone(),
            not_serving_reason: e.message().to_string(),
            ..Default::default()
        },
    }
}

// ---------------------------------------------------------------- routing

/// What a request asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// Not under `/console`: the metrics port's own answer.
    NotConsole,
    /// `console_enabled = false`.
    Disabled,
    MethodNotAllowed,
    Overview,
    Transactions(ListQuery),
    InDoubt,
    Txn(u64),
    Sagas(sagas::SagaQuery),
    Saga(u64),
    BadRequest(String),
    NotFound,
}

/// The filters of `/console/transactions` (`ListTransactions`' own).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListQuery {
    pub state: Option<StateFilter>,
    pub unacknowledged: bool,
    pub dropped: bool,
    pub participant: Option<String>,
    pub after: u64,
}

impl ListQuery {
    /// The state machine's filter for this query (ages are not filtered).
    pub fn filter(&self) -> ListFilter {
        ListFilter {
            state: self.state,
            min_age_ms: 0,
            now_ms: 0,
            participant: self.participant.clone(),
            unacknowledged: self.unacknowledged,
            dropped: self.dropped,
        }
    }

    /// The URL of this query (`after` included when not 0).
    pub fn url(&self) -> String {
        let mut parts = Vec::new();
        if let Some(s) = self.state {
            parts.push(format!("state={}", state_param(s)));
        }
        if self.unacknowledged {
            parts.push("unacknowledged=1".into());
        }
        if self.dropped {
            parts.push("dropped=1".into());
        }
        if let Some(p) = &self.participant {
            parts.push(format!("participant={}", pct(p)));
        }
        if self.after != 0 {
            parts.push(format!("after={}", self.after));
        }
        if parts.is_empty() {
            "/console/transactions".into()
        } else {
            format!("/console/transactions?{}", parts.join("&"))
        }
    }

    /// In words, for the page's heading.
    pub fn describe(&self) -> String {
        let mut w = Vec::new();
        if let Some(s) = self.state {
            w.push(format!("state {}", state_param(s).to_uppercase()));
        }
        if self.unacknowledged {
            w.push("decided, waiting for a participant's ack (not dropped)".into());
        }
        if self.dropped {
            w.push("a dropped participant never acked (reconcile by hand)".into());
        }
        if let Some(p) = &self.participant {
            w.push(format!("participant {p}"));
        }
        if w.is_empty() {
            "all".into()
        } else {
            w.join("; ")
        }
    }
}

fn state_param(s: StateFilter) -> &'static str {
    match s {
        StateFilter::Active => "active",
        StateFilter::Preparing => "preparing",
        StateFilter::Decided => "decided",
    }
}

/// Routes a request. GET only; the path decides the page, and only the
/// transactions page reads its query.
pub fn route(method: &str, path_and_query: &str, enabled: bool) -> Route {
    let (path, query) = match path_and_query.split_once('?') {
        Some((p, q)) => (p, q),
        None => (path_and_query, ""),
    };
    let Some(rest) = path.strip_prefix("/console") else {
        return Route::NotConsole;
    };
    if !(rest.is_empty() || rest.starts_with('/')) {
        // "/consoles" and the like are not the console's.
        return Route::NotConsole;
    }
    if !enabled {
        return Route::Disabled;
    }
    if method != "GET" {
        return Route::MethodNotAllowed;
    }
    let rest = rest.trim_end_matches('/');
    match rest {
        "" => Route::Overview,
        "/transactions" => match parse_list_query(query) {
            Ok(q) => Route::Transactions(q),
            Err(e) => Route::BadRequest(e),
        },
        "/in-doubt" => Route::InDoubt,
        "/sagas" => match sagas::parse_query(query) {
            Ok(q) => Route::Sagas(q),
            Err(e) => Route::BadRequest(e),
        },
        _ if rest.starts_with("/saga/") => {
            let t = &rest["/saga/".len()..];
            match t.parse::<u64>() {
                Ok(id) => Route::Saga(id),
                Err(_) => Route::BadRequest(format!(
                    "{:?} is not a saga id (a saga id is a whole number)",
                    pct_decode(t).unwrap_or_else(|_| t.to_string())
                )),
            }
        }
        _ => match rest.strip_prefix("/txn/") {
            Some(t) => match t.parse::<u64>() {
                Ok(txid) => Route::Txn(txid),
                Err(_) => Route::BadRequest(format!(
                    "{:?} is not a transaction id (a txid is a whole number)",
                    pct_decode(t).unwrap_or_else(|_| t.to_string())
                )),
            },
            None => Route::NotFound,
        },
    }
}

/// The query of `/console/transactions`; unknown keys and bad values are
/// refused with a message naming them (a typo must not show an unfiltered
/// list as if it were filtered).
pub fn parse_list_query(query: &str) -> Result<ListQuery, String> {
    let mut q = ListQuery::default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let key = pct_decode(k)?;
        let value = pct_decode(v)?;
        match key.as_str() {
            "state" => {
                q.state = match value.to_ascii_lowercase().as_str() {
                    "" | "any" | "all" => None,
                    "active" => Some(StateFilter::Active),
                    "preparing" => Some(StateFilter::Preparing),
                    "decided" => Some(StateFilter::Decided),
                    _ => return Err(format!("state {value:?} is not one of active, preparing, decided")),
                }
            }
            "unacknowledged" => q.unacknowledged = flag(&key, &value)?,
            "dropped" => q.dropped = flag(&key, &value)?,
            "participant" => {
                if value.len() > limits::ID_BYTES_MAX {
                    return Err(format!(
                        "participant is {} bytes; the limit is {} bytes",
                        value.len(),
                        limits::ID_BYTES_MAX
                    ));
                }
                q.participant = (!value.is_empty()).then_some(value);
            }
            "after" => {
                q.after = if value.is_empty() {
                    0
                } else {
                    value
                        .parse()
                        .map_err(|_| format!("after {value:?} is not a transaction id"))?
                }
            }
            _ => {
                return Err(format!(
                    "unknown parameter {key:?}: the filters are state, unacknowledged, dropped, participant and after"
                ))
            }
        }
    }
    Ok(q)
}

fn flag(key: &str, value: &str) -> Result<bool, String> {
    match value {
        "" | "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(format!("{key} {value:?} is not 1 or 0")),
    }
}

// ------------------------------------------------------------- the data

/// Transactions by state in this node's table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub total: usize,
    pub active: usize,
    pub preparing: usize,
    pub decided: usize,
    /// Decided, waiting for the ack of a participant that was not dropped.
    pub unacknowledged: usize,
    /// A dropped participant never acked: reconcile by hand.
    pub dropped: usize,
}

impl Counts {
    /// One pass over the records (cheap beside a snapshot, which copies
    /// them all); the indexes give the rest.
    pub fn of(t: &TxTable) -> Counts {
        let mut c = Counts {
            total: t.len(),
            preparing: t.preparing_count(),
            unacknowledged: t.undelivered_count(),
            dropped: t.drops().keys().filter(|x| t.needs_reconciliation(**x)).count(),
            ..Counts::default()
        };
        for r in t.records() {
            match r.phase {
                Phase::Active => c.active += 1,
                Phase::Preparing => {}
                Phase::Decided(_) => c.decided += 1,
            }
        }
        c
    }

    /// These counts with `retained` more decided records, kept on disk
    /// only (ADR 0050).
    pub fn with_retained(mut self, retained: u64) -> Counts {
        self.total += retained as usize;
        self.decided += retained as usize;
        self
    }
}

/// One page of `q` from `st` (the records in memory and the retained
/// ones), as the API shows records, and the txid to list after for the
/// next page (0 when nothing follows).
pub fn list_page(st: &SmState, q: &ListQuery) -> Result<(Vec<pb::StatusResponse>, u64), RetainedReadError> {
    let page = st.list(
        &q.filter(),
        q.after,
        PAGE_RECORDS,
        limits::LIST_TRANSACTIONS_SCAN_RECORDS_MAX,
    )?;
    let mut rows = Vec::with_capacity(page.txids.len());
    for x in &page.txids {
        rows.extend(st.with_txid(*x, |t| t.get(*x).map(|r| status_pb(t, r)))?);
    }
    Ok((rows, page.next_after))
}

/// Every PREPARING and every decided-unacknowledged transaction (at most
/// [`IN_DOUBT_MAX`] of each, the lowest txids), oldest first; true when
/// some were left out.
pub fn in_doubt(t: &TxTable) -> (Vec<pb::StatusResponse>, bool) {
    let mut cut = false;
    let mut rows = Vec::new();
    for filter in [
        ListFilter {
            state: Some(StateFilter::Preparing),
            ..ListFilter::default()
        },
        ListFilter {
            unacknowledged: true,
            ..ListFilter::default()
        },
    ] {
        let page = t.list(&filter, 0, IN_DOUBT_MAX, limits::LIST_TRANSACTIONS_SCAN_RECORDS_MAX);
        cut |= page.next_after != 0;
        rows.extend(page.txids.iter().filter_map(|x| t.get(*x)).map(|r| status_pb(t, r)));
    }
    oldest_first(&mut rows);
    (rows, cut)
}

/// By begin time, then txid.
pub fn oldest_first(rows: &mut [pb::StatusResponse]) {
    rows.sort_by_key(|r| (r.begun_unix_ms, r.txid));
}

// ------------------------------------------------------------ rendering

pub use dtx_common::view::outcome_name;
pub use dtx_common::view::phase_two;
pub use dtx_common::view::reach_name;
pub use dtx_common::view::source_name;
pub use dtx_common::view::span;
pub use dtx_common::view::state_line;
pub use dtx_common::view::state_name;
pub use dtx_common::view::timeline;
pub use dtx_common::view::utc;
pub use dtx_common::view::waiting_on;

fn state_badge(t: &pb::StatusResponse) -> String {
    let class = match (&t.decision, state_name(t.state)) {
        (Some(d), _) if outcome_name(d.outcome) == "COMMIT" => "s-commit",
        (Some(_), _) => "s-abort",
        (None, "PREPARING") => "s-preparing",
        _ => "s-active",
    };
    format!("<span class=\"s {class}\">{}</span>", esc(&state_line(t)))
}

fn txid_link(txid: u64) -> String {
    format!("<a href=\"/console/txn/{txid}\">{txid}</a>")
}

fn count_cell(n: usize, url: &str) -> String {
    format!("<td class=\"n\"><a href=\"{}\">{n}</a></td>", esc(url))
}

/// `/console`.
pub fn render_overview(
    f: &Frame,
    s: &pb::ClusterStatusResponse,
    c: &Counts,
    saga_counts: &[(&'static str, usize, String)],
) -> String {
    let mut b = String::new();
    // This node beside the leader and the counts; the members below.
    b.push_str("<div class=\"cols\"><section><h2>This node</h2><table id=\"this-node\">");
    let serving = if s.serving {
        "<span class=\"ok\">SERVING</span>".to_string()
    } else {
        format!("<span class=\"bad\">NOT SERVING</span>: {}", esc(&s.not_serving_reason))
    };
    for (k, v) in [
        ("node", format!("{}", s.node_id)),
        ("role", esc(&s.role)),
        ("serving", serving),
        ("term", s.term.to_string()),
        ("last log index", s.last_log_index.to_string()),
        ("applied index", s.last_applied_index.to_string()),
        ("snapshot index", s.snapshot_index.to_string()),
        ("purged index", s.purged_index.to_string()),
        ("transactions held", s.transactions.to_string()),
        ("next txid", s.next_txid.to_string()),
    ] {
        let _ = write!(b, "<tr><th>{k}</th><td>{v}</td></tr>");
    }
    b.push_str("</table></section><section>");
    let _ = write!(b, "<h2>Leader</h2><p id=\"leader\">{}</p>", f.leader_html());

    b.push_str("<h2>Transactions by state</h2><table id=\"counts\"><tr><th>STATE</th><th>COUNT</th></tr>");
    let rows = [
        ("ACTIVE", c.active, "/console/transactions?state=active"),
        ("PREPARING", c.preparing, "/console/transactions?state=preparing"),
        ("DECIDED", c.decided, "/console/transactions?state=decided"),
        (
            "decided, waiting for ack",
            c.unacknowledged,
            "/console/transactions?unacknowledged=1",
        ),
        (
            "DROPPED: reconcile by hand",
            c.dropped,
            "/console/transactions?dropped=1",
        ),
        (
            "in doubt (PREPARING or waiting for ack)",
            c.preparing + c.unacknowledged,
            "/console/in-doubt",
        ),
        ("all", c.total, "/console/transactions"),
    ];
    for (name, n, url) in rows {
        let _ = write!(b, "<tr><td>{name}</td>{}</tr>", count_cell(n, url));
    }
    b.push_str("</table>");
    b.push_str("<h2>Sagas by state</h2><table id=\"saga-counts\"><tr><th>STATE</th><th>COUNT</th></tr>");
    for (name, n, url) in saga_counts {
        let name = if *name == "PARKED" && *n > 0 {
            "<span class=\"bad\">PARKED: waiting for an operator</span>".to_string()
        } else {
            name.to_string()
        };
        let _ = write!(b, "<tr><td>{name}</td>{}</tr>", count_cell(*n, url));
    }
    b.push_str("</table></section></div>");

    let leads = s.role == "Leader";
    b.push_str(
        "<h2>Members</h2><table id=\"members\"><tr><th>NODE</th><th>API ADDRESS</th><th>RAFT ADDRESS</th>\
         <th>KIND</th><th>MATCHED</th><th>LAG</th><th>REACH</th></tr>",
    );
    for m in &s.members {
        let reach = match pb::MemberReach::try_from(m.reach) {
            Ok(pb::MemberReach::Reachable) => format!(
                "<span class=\"ok\">reachable</span> ({} ago)",
                span(m.last_heard_ms_ago)
            ),
            Ok(pb::MemberReach::Unreachable) => format!(
                "<span class=\"bad\">unreachable</span> ({} ago)",
                span(m.last_heard_ms_ago)
            ),
            _ => reach_name(m.reach).to_string(),
        };
        let mut node = m.node_id.to_string();
        if m.node_id == s.leader_id {
            node.push_str(" (leader)");
        }
        if m.node_id == s.node_id {
            node.push_str(" (this node)");
        }
        let _ = write!(
            b,
            "<tr><td>{node}</td><td class=\"mono\">{}</td><td class=\"mono\">{}</td><td>{}</td>\
             <td class=\"n\">{}</td><td class=\"n\">{}</td><td>{reach}</td></tr>",
            esc(&m.api_addr),
            esc(&m.raft_addr),
            if m.voter { "voter" } else { "learner" },
            if leads { m.matched_index.to_string() } else { "?".into() },
            if leads { m.lag_entries.to_string() } else { "?".into() },
        );
    }
    b.push_str("</table>");
    if !leads {
        b.push_str(
            "<p class=\"muted\">Matched index, lag and the reach of every member are known on the leader only; \
             this node knows the leader's reach from its last Raft message.</p>",
        );
    }

    page(f, "Cluster", true, &b)
}

/// The list table: one row per transaction (`admin txn list`'s columns).
fn tx_table(b: &mut String, rows: &[pb::StatusResponse], now_ms: u64, with_begun: bool) {
    b.push_str("<table class=\"txs\"><tr><th>TXID</th><th>STATE</th>");
    if with_begun {
        b.push_str("<th>BEGUN (UTC)</th>");
    }
    b.push_str("<th>AGE</th><th>PARTICIPANTS</th><th>WAITING ON</th><th>NOTE</th></tr>");
    for t in rows {
        let waiting: Vec<String> = waiting_on(t)
            .iter()
            .map(|p| {
                if p.last_delivery_error.is_empty() {
                    esc(&p.id)
                } else {
                    format!("{} ({} attempts)", esc(&p.id), p.delivery_attempts)
                }
            })
            .collect();
        let dropped: Vec<&str> = t
            .participants
            .iter()
            .filter(|p| p.dropped && !p.acked)
            .map(|p| p.id.as_str())
            .collect();
        let mut note = t.decision.as_ref().map(|d| d.note.clone()).unwrap_or_default();
        if !dropped.is_empty() {
            note = format!("DROPPED {} (reconcile by hand); {note}", dropped.join(","));
        }
        let _ = write!(b, "<tr><td>{}</td><td>{}</td>", txid_link(t.txid), state_badge(t));
        if with_begun {
            let _ = write!(b, "<td class=\"mono\">{}</td>", utc(t.begun_unix_ms));
        }
        let _ = write!(
            b,
            "<td class=\"n\">{}</td><td>{}/{} acked</td><td class=\"waiting\">{}</td><td>{}</td></tr>",
            span(now_ms.saturating_sub(t.begun_unix_ms)),
            t.participants.iter().filter(|p| p.acked).count(),
            t.participants.len(),
            if waiting.is_empty() {
                "-".into()
            } else {
                waiting.join(", ")
            },
            esc(&note)
        );
    }
    b.push_str("</table>");
}

/// `/console/transactions`.
pub fn render_transactions(f: &Frame, q: &ListQuery, rows: &[pb::StatusResponse], next_after: u64) -> String {
    let mut b = String::new();
    b.push_str("<nav class=\"f\">Filter: ");
    let base = ListQuery {
        participant: q.participant.clone(),
        ..ListQuery::default()
    };
    let links = [
        ("all", base.clone()),
        (
            "ACTIVE",
            ListQuery {
                state: Some(StateFilter::Active),
                ..base.clone()
            },
        ),
        (
            "PREPARING",
            ListQuery {
                state: Some(StateFilter::Preparing),
                ..base.clone()
            },
        ),
        (
            "DECIDED",
            ListQuery {
                state: Some(StateFilter::Decided),
                ..base.clone()
            },
        ),
        (
            "waiting for ack",
            ListQuery {
                unacknowledged: true,
                ..base.clone()
            },
        ),
        (
            "DROPPED",
            ListQuery {
                dropped: true,
                ..base.clone()
            },
        ),
    ];
    for (name, l) in links {
        let _ = write!(b, "<a href=\"{}\">{name}</a>", esc(&l.url()));
    }
    b.push_str("</nav>");
    let _ = write!(
        b,
        "<p id=\"filter\">Showing: {}{} · by txid, up to {PAGE_RECORDS} a page · ages by this node's clock.</p>",
        esc(&q.describe()),
        if q.after == 0 {
            String::new()
        } else {
            format!(" · after txid {}", q.after)
        }
    );
    if rows.is_empty() {
        b.push_str("<p id=\"empty\">No transaction on this page matches.</p>");
    } else {
        tx_table(&mut b, rows, f.now_ms, false);
    }
    if next_after != 0 {
        let next = ListQuery {
            after: next_after,
            ..q.clone()
        };
        let _ = write!(
            b,
            "<p><a id=\"next\" href=\"{}\">next page (after txid {next_after})</a></p>",
            esc(&next.url())
        );
    } else {
        let _ = write!(b, "<p class=\"muted\">({} transactions; the last page)</p>", rows.len());
    }
    page(f, "Transactions", false, &b)
}

/// `/console/in-doubt`.
pub fn render_in_doubt(f: &Frame, rows: &[pb::StatusResponse], cut: bool) -> String {
    let mut b = String::new();
    b.push_str(
        "<p>Every PREPARING transaction (its participants may hold YES votes and locks) and every decided one a \
         participant has not acknowledged yet (phase two is not finished), oldest first, with the participants \
         still waiting (ages by this node's clock). A participant an operator dropped is not waited on.</p>",
    );
    if rows.is_empty() {
        b.push_str(
            "<p id=\"empty\">nothing in doubt: no transaction is preparing and every decision is acknowledged</p>",
        );
    } else {
        tx_table(&mut b, rows, f.now_ms, true);
        let _ = write!(b, "<p class=\"muted\">({} transactions, oldest first)</p>", rows.len());
    }
    if cut {
        let _ = write!(
            b,
            "<p class=\"warn\">More than {IN_DOUBT_MAX} of a kind: only the lowest txids of each are shown. See \
             <a href=\"/console/transactions?state=preparing\">PREPARING</a> and \
             <a href=\"/console/transactions?unacknowledged=1\">waiting for ack</a> for all of them.</p>"
        );
    }
    page(f, "In doubt", true, &b)
}

/// `/console/txn/<txid>`.
pub fn render_txn(f: &Frame, t: &pb::StatusResponse) -> String {
    let mut b = String::new();
    let _ = write!(b, "<p id=\"state\">{}", state_badge(t));
    if t.one_phase {
        b.push_str(" (one-phase commit)");
    }
    if !t.owner.is_empty() {
        let _ = write!(b, " · owner <span class=\"mono\">{}</span>", esc(&t.owner));
    }
    b.push_str("</p>");

    b.push_str("<h2>Timeline (the leader's clock, UTC)</h2><table id=\"timeline\"><tr><th>WHEN</th><th>WHAT</th></tr>");
    for (when, what) in timeline(t, f.now_ms) {
        let _ = write!(
            b,
            "<tr><td class=\"mono\">{}</td><td>{}</td></tr>",
            utc(when),
            esc(&what)
        );
    }
    b.push_str("</table>");

    let decided = t.decision.is_some();
    b.push_str(
        "<h2>Participants</h2><table id=\"participants\"><tr><th>ID</th><th>ADDRESS</th><th>PHASE TWO</th>\
         <th>ATTEMPTS</th><th>NEXT RETRY</th><th>LAST ERROR</th></tr>",
    );
    for p in &t.participants {
        let word = phase_two(p, decided);
        let class = match word {
            "acked" => "ok",
            "waiting for ack" => "warn",
            "-" => "muted",
            _ => "bad",
        };
        let mut phase = format!("<span class=\"{class}\">{}</span>", esc(word));
        if p.dropped {
            let _ = write!(
                phase,
                "<br><span class=\"muted\">{} at {}</span>",
                esc(&p.dropped_note),
                utc(p.dropped_unix_ms)
            );
        }
        let _ = write!(
            b,
            "<tr><td>{}</td><td class=\"mono\">{}</td><td>{phase}</td><td class=\"n\">{}</td><td>{}</td>\
             <td class=\"mono\">{}</td></tr>",
            esc(&p.id),
            esc(&p.address),
            if p.delivery_attempts == 0 {
                "-".into()
            } else {
                p.delivery_attempts.to_string()
            },
            if p.next_delivery_unix_ms == 0 {
                "-".into()
            } else {
                format!("in {}", span(p.next_delivery_unix_ms.saturating_sub(f.now_ms)))
            },
            if p.last_delivery_error.is_empty() {
                "-".into()
            } else {
                esc(&p.last_delivery_error)
            },
        );
    }
    b.push_str("</table>");
    if f.leads() {
        b.push_str(
            "<p class=\"muted\">Attempts, next retry and last error are this leader's own (not replicated): after a \
             leader change they start again from 0.</p>",
        );
    } else {
        let _ = write!(
            b,
            "<p class=\"muted\">Attempts, next retry and last error are the leader's own (not replicated): this node \
             does not lead, so it has none to show; the leader: {}.</p>",
            f.leader_html()
        );
    }
    page(f, &format!("Transaction {}", t.txid), false, &b)
}

/// The 404 page of `/console/txn/<txid>`.
pub fn render_txn_not_found(f: &Frame, txid: u64) -> String {
    let b = format!(
        "<p id=\"not-found\">transaction {txid} not found: never begun here, or forgotten after every participant \
         acked (a participant asking about it is told: unknown, presumed abort).</p>\
         <p class=\"muted\">This page shows this node's applied state: a transaction begun a moment ago may not be \
         applied here yet.</p>"
    );
    page(f, &format!("Transaction {txid}"), false, &b)
}

/// A 503 page: a retained record could not be read (ADR 0050).
pub fn render_unreadable(f: &Frame, why: &str) -> String {
    page(
        f,
        "Unavailable",
        false,
        &format!("<p id=\"error\">{}; try again</p>", esc(why)),
    )
}

/// A 400 or 404 page.
pub fn render_error(f: &Frame, status: u16, why: &str) -> String {
    let title = if status == 400 { "Bad request" } else { "Not found" };
    page(f, title, false, &format!("<p id=\"error\">{}</p>", esc(why)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sm::Decision;
    use crate::sm::DecisionSource;
    use crate::sm::Outcome;
    use crate::sm::Participant;
    use crate::sm::TxRecord;

    const EVIL: &str = "<script>alert(\"x\")</script>'&";

    #[test]
    fn esc_escapes_markup_and_both_quotes() {
        assert_eq!(esc(EVIL), "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&#39;&amp;");
        assert_eq!(esc("bank-a 10.0.0.1:7000 ünï"), "bank-a 10.0.0.1:7000 ünï");
        assert_eq!(esc(""), "");
        for bad in ['<', '>', '"', '\''] {
            assert!(!esc(EVIL).contains(bad), "{bad} left in {}", esc(EVIL));
        }
    }

    #[test]
    fn routes_are_get_only_and_off_when_disabled() {
        assert_eq!(route("GET", "/metrics", true), Route::NotConsole);
        assert_eq!(route("GET", "/health", true), Route::NotConsole);
        assert_eq!(route("GET", "/consoles", true), Route::NotConsole);
        assert_eq!(route("GET", "/console", true), Route::Overview);
        assert_eq!(route("GET", "/console/", true), Route::Overview);
        assert_eq!(route("GET", "/console?x=1", true), Route::Overview);
        assert_eq!(route("GET", "/console/in-doubt", true), Route::InDoubt);
        assert_eq!(route("GET", "/console/txn/42", true), Route::Txn(42));
        assert_eq!(route("GET", "/console/txn/42/", true), Route::Txn(42));
        assert!(matches!(route("GET", "/console/txn/x1", true), Route::BadRequest(m) if m.contains("\"x1\"")));
        assert_eq!(route("GET", "/console/nope", true), Route::NotFound);
        for m in ["POST", "PUT", "DELETE", "HEAD", "PATCH"] {
            assert_eq!(route(m, "/console", true), Route::MethodNotAllowed, "{m}");
            assert_eq!(route(m, "/console/txn/1", true), Route::MethodNotAllowed, "{m}");
        }
        assert_eq!(route("GET", "/console", false), Route::Disabled);
        assert_eq!(route("POST", "/console/txn/1", false), Route::Disabled);
        assert_eq!(route("GET", "/metrics", false), Route::NotConsole);
    }

    #[test]
    fn list_queries_parse_strictly_and_round_trip() {
        let q = match route(
            "GET",
            "/console/transactions?state=preparing&unacknowledged=1&dropped=0&participant=bank%2Fb+x&after=17",
            true,
        ) {
            Route::Transactions(q) => q,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            q,
            ListQuery {
                state: Some(StateFilter::Preparing),
                unacknowledged: true,
                dropped: false,
                participant: Some("bank/b x".into()),
                after: 17,
            }
        );
        assert_eq!(parse_list_query(&q.url()["/console/transactions?".len()..]).unwrap(), q);
        assert_eq!(parse_list_query("").unwrap(), ListQuery::default());
        assert_eq!(ListQuery::default().url(), "/console/transactions");
        for (bad, says) in [
            ("state=done", "state"),
            ("unacked=1", "unknown parameter"),
            ("after=x", "after"),
            ("dropped=maybe", "dropped"),
            ("participant=%zz", "percent"),
        ] {
            let e = parse_list_query(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let long = "p".repeat(limits::ID_BYTES_MAX + 1);
        assert!(parse_list_query(&format!("participant={long}")).is_err());
        // The filter is the state machine's, with the same fields.
        let f = q.filter();
        assert_eq!(f.state, Some(StateFilter::Preparing));
        assert!(f.unacknowledged && !f.dropped);
        assert_eq!(f.participant.as_deref(), Some("bank/b x"));
    }

    #[test]
    fn times_read_as_the_cli_prints_them() {
        assert_eq!(utc(0), "-");
        assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(utc(1_764_606_001_123), "2025-12-01T16:20:01.123Z");
        assert_eq!(span(850), "850ms");
        assert_eq!(span(12_400), "12.4s");
        assert_eq!(span(310_000), "5m10s");
    }

    fn part(id: &str, acked: bool) -> Participant {
        Participant {
            id: id.into(),
            address: format!("127.0.0.1:{}", 7000 + id.len()),
            payload: Vec::new(),
            acked,
        }
    }

    fn rec(txid: u64, begun_ms: u64, phase: Phase, parts: Vec<Participant>) -> TxRecord {
        TxRecord {
            txid,
            idempotency_key: format!("k{txid}"),
            fingerprint: [0; 32],
            begun_ms,
            deadline_ms: begun_ms + 30_000,
            phase,
            participants: parts,
            one_phase: false,
        }
    }

    fn decided(outcome: Outcome, source: DecisionSource, at: u64, note: &str) -> Phase {
        Phase::Decided(Decision {
            outcome,
            source,
            term: 3,
            decided_ms: at,
            note: note.into(),
        })
    }

    /// 1 ACTIVE, 2 and 5 PREPARING (5 begun earliest), 3 COMMIT fully
    /// acked, 4 COMMIT waiting on `EVIL`.
    fn table() -> TxTable {
        TxTable::from_parts(
            10,
            [
                rec(1, 5_000, Phase::Active, vec![part("a", false)]),
                rec(2, 6_000, Phase::Preparing, vec![part("a", false), part("b", false)]),
                rec(
                    3,
                    7_000,
                    decided(Outcome::Commit, DecisionSource::Driver, 7_100, ""),
                    vec![part("a", true), part("b", true)],
                ),
                rec(
                    4,
                    4_000,
                    decided(Outcome::Commit, DecisionSource::Driver, 4_200, "all voted YES"),
                    vec![part("a", true), part(EVIL, false)],
                ),
                rec(5, 1_000, Phase::Preparing, vec![part("c", false)]),
            ],
        )
    }

    #[test]
    fn counts_and_lists_come_from_the_table_and_its_filter() {
        let t = table();
        assert_eq!(
            Counts::of(&t),
            Counts {
                total: 5,
                active: 1,
                preparing: 2,
                decided: 2,
                unacknowledged: 1,
                dropped: 0,
            }
        );
        let ids = |q: &ListQuery| {
            list_page(&SmState::of_table(t.clone()), q)
                .unwrap()
                .0
                .iter()
                .map(|r| r.txid)
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(&ListQuery::default()), [1, 2, 3, 4, 5]);
        assert_eq!(
            ids(&ListQuery {
                state: Some(StateFilter::Preparing),
                ..Default::default()
            }),
            [2, 5]
        );
        assert_eq!(
            ids(&ListQuery {
                unacknowledged: true,
                ..Default::default()
            }),
            [4]
        );
        assert_eq!(
            ids(&ListQuery {
                participant: Some("b".into()),
                ..Default::default()
            }),
            [2, 3]
        );
        assert_eq!(
            ids(&ListQuery {
                after: 3,
                ..Default::default()
            }),
            [4, 5]
        );
        // In doubt: PREPARING and waiting for ack, oldest begun first.
        let (rows, cut) = in_doubt(&t);
        assert!(!cut);
        assert_eq!(rows.iter().map(|r| r.txid).collect::<Vec<_>>(), [5, 4, 2]);
    }

    #[test]
    fn a_full_page_links_to_the_next_with_the_same_filters() {
        let records = (1..=PAGE_RECORDS as u64 + 5).map(|x| rec(x, x, Phase::Active, vec![part("a&b", false)]));
        let t = TxTable::from_parts(1, records);
        let q = ListQuery {
            participant: Some("a&b".into()),
            ..Default::default()
        };
        let (rows, next) = list_page(&SmState::of_table(t.clone()), &q).unwrap();
        assert_eq!(rows.len(), PAGE_RECORDS);
        assert_eq!(next, PAGE_RECORDS as u64);
        let html = render_transactions(&frame(2, 1), &q, &rows, next);
        assert!(
            html.contains("href=\"/console/transactions?participant=a%26b&amp;after=100\""),
            "{html}"
        );
        let q2 = parse_list_query("participant=a%26b&after=100").unwrap();
        let (rows, next) = list_page(&SmState::of_table(t.clone()), &q2).unwrap();
        assert_eq!((rows.len(), next), (5, 0));
        assert!(render_transactions(&frame(2, 1), &q2, &rows, next).contains("the last page"));
    }

    fn frame(node: u64, leader: u64) -> Frame {
        Frame {
            cluster_id: "dtx-test".into(),
            node_id: node,
            role: if node == leader { "Leader" } else { "Follower" }.into(),
            term: 3,
            applied_index: 42,
            serving: true,
            leader_id: leader,
            leader_api_addr: "127.0.0.1:7201".into(),
            leader_console: (node == leader).then(|| "/console".into()),
            now_ms: 10_000,
        }
    }

    fn status_of(t: &TxTable, txid: u64) -> pb::StatusResponse {
        status_pb(t, t.get(txid).unwrap())
    }

    #[test]
    fn every_page_says_who_rendered_it_from_what() {
        let follower = render_error(&frame(2, 1), 404, "x");
        assert!(
            follower.contains("Rendered by <b>node 2</b> (Follower, term 3)"),
            "{follower}"
        );
        assert!(follower.contains("this node's applied state</b> (applied index 42)"));
        assert!(follower.contains("A follower may lag the leader by a few entries"));
        assert!(follower.contains("node 1 at <span class=\"mono\">127.0.0.1:7201</span>"));
        // No console address for another node: no link to it.
        assert!(!follower.contains("its console"));
        let with_link = Frame {
            leader_console: Some("http://10.0.0.1:9101/console".into()),
            ..frame(2, 1)
        };
        assert!(render_error(&with_link, 404, "x").contains("<a href=\"http://10.0.0.1:9101/console\">its console</a>"));
        let leader = render_error(&frame(1, 1), 404, "x");
        assert!(leader.contains("This node is the leader."), "{leader}");
        let none = render_error(&frame(2, 0), 404, "x");
        assert!(none.contains("none known"), "{none}");
        for p in [&follower, &leader] {
            assert!(p.starts_with("<!DOCTYPE html>"));
            assert!(!p.contains("<script"), "no scripts");
            assert!(!p.contains("<form"), "no forms");
            assert!(p.contains("no authentication"));
        }
    }

    #[test]
    fn data_is_escaped_on_every_page() {
        let t = table();
        let evil_frame = Frame {
            cluster_id: EVIL.into(),
            role: EVIL.into(),
            leader_api_addr: EVIL.into(),
            ..frame(2, 1)
        };
        let mut s = status_of(&t, 4);
        s.owner = EVIL.into();
        s.participants[1].last_delivery_error = EVIL.into();
        s.participants[1].delivery_attempts = 3;
        let (rows, _) = in_doubt(&t);
        let status = pb::ClusterStatusResponse {
            cluster_id: EVIL.into(),
            role: EVIL.into(),
            not_serving_reason: EVIL.into(),
            members: vec![pb::NodeStatus {
                node_id: 1,
                api_addr: EVIL.into(),
                raft_addr: EVIL.into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let q = ListQuery {
            participant: Some(EVIL.into()),
            ..Default::default()
        };
        for html in [
            render_txn(&evil_frame, &s),
            render_in_doubt(&evil_frame, &rows, false),
            render_transactions(&evil_frame, &q, &rows, 9),
            render_overview(&evil_frame, &status, &Counts::default(), &[]),
            render_error(&evil_frame, 400, EVIL),
        ] {
            assert!(!html.contains("<script"), "unescaped: {html}");
            assert!(!html.contains("alert(\""), "unescaped quote: {html}");
            assert!(html.contains("&lt;script&gt;"), "{html}");
        }
    }

    #[test]
    fn a_timeline_reads_like_txn_show() {
        let t = table();
        let mut s = status_of(&t, 4);
        s.participants[1].delivery_attempts = 7;
        s.participants[1].last_delivery_error = "Unavailable: connection refused".into();
        s.participants[1].next_delivery_unix_ms = 11_500;
        let html = render_txn(&frame(1, 1), &s);
        for want in [
            "DECIDED COMMIT",
            "begin (deadline 1970-01-01T00:00:34.000Z, 30.0s after begin)",
            "enlisted a at 127.0.0.1:7001, &lt;script&gt;",
            "votes: YES from every participant (a, &lt;script&gt;",
            "decided COMMIT by the driver in term 3: all voted YES",
            ">acked<",
            ">waiting for ack<",
            ">7<",
            "in 1.5s",
            "Unavailable: connection refused",
            "this leader's own",
        ] {
            assert!(html.contains(want), "{want:?} missing from {html}");
        }
        // Dropped, on a follower: the note, and no attempts of its own.
        s.participants[1].dropped = true;
        s.participants[1].dropped_note = "operator alice: <gone>".into();
        s.participants[1].dropped_unix_ms = 9_000;
        let html = render_txn(&frame(2, 1), &s);
        assert!(html.contains("DROPPED: reconcile by hand"), "{html}");
        assert!(
            html.contains("operator alice: &lt;gone&gt; at 1970-01-01T00:00:09.000Z"),
            "{html}"
        );
        assert!(
            html.contains("dropped from phase two: operator alice: &lt;gone&gt;"),
            "{html}"
        );
        assert!(html.contains("this node does not lead"), "{html}");
        // Undecided: the preparing line; an aborted one says why not COMMIT.
        let html = render_txn(&frame(1, 1), &status_of(&t, 2));
        assert!(
            html.contains("preparing: votes are being collected (no decision yet)"),
            "{html}"
        );
        let mut aborted = status_of(&t, 3);
        aborted.decision = Some(pb::Decision {
            outcome: pb::Outcome::Abort as i32,
            source: pb::DecisionSource::Client as i32,
            term: 2,
            decided_unix_ms: 7_100,
            note: "client: gave up".into(),
        });
        let html = render_txn(&frame(1, 1), &aborted);
        assert!(html.contains("DECIDED ABORT"), "{html}");
        assert!(
            html.contains("decided ABORT by the client in term 2: client: gave up"),
            "{html}"
        );
        assert!(html.contains("votes: none counted: the client aborted it"), "{html}");
        // The driver's ABORT: its note names each participant's vote.
        aborted.decision = Some(pb::Decision {
            outcome: pb::Outcome::Abort as i32,
            source: pb::DecisionSource::Driver as i32,
            term: 2,
            decided_unix_ms: 7_100,
            note: "bank-b voted NO: funds; YES from bank-a".into(),
        });
        let html = render_txn(&frame(1, 1), &aborted);
        assert!(
            html.contains("votes: bank-b voted NO: funds; YES from bank-a"),
            "{html}"
        );
    }

    #[test]
    fn the_unknown_txid_page_says_why() {
        let html = render_txn_not_found(&frame(2, 1), 99);
        assert!(
            html.contains("transaction 99 not found: never begun here, or forgotten after every participant acked"),
            "{html}"
        );
    }

    #[test]
    fn in_doubt_lists_the_waiting_participants_oldest_first() {
        let t = table();
        let (rows, cut) = in_doubt(&t);
        let html = render_in_doubt(&frame(1, 1), &rows, cut);
        let at = |s: &str| html.find(s).unwrap_or_else(|| panic!("{s} missing from {html}"));
        assert!(at("/console/txn/5\"") < at("/console/txn/4\"") && at("/console/txn/4\"") < at("/console/txn/2\""));
        assert!(html.contains("<td class=\"waiting\">&lt;script&gt;"), "{html}");
        assert!(html.contains("<td class=\"waiting\">a, b</td>"), "{html}");
        assert!(html.contains("(3 transactions, oldest first)"));
        let empty = render_in_doubt(&frame(1, 1), &[], false);
        assert!(empty.contains("nothing in doubt"));
        assert!(render_in_doubt(&frame(1, 1), &rows, true).contains("More than 1000"));
    }

    #[test]
    fn the_overview_shows_members_and_counts() {
        let s = pb::ClusterStatusResponse {
            cluster_id: "dtx-test".into(),
            node_id: 1,
            role: "Leader".into(),
            leader_id: 1,
            leader_api_addr: "127.0.0.11:7201".into(),
            term: 3,
            last_applied_index: 42,
            serving: true,
            members: vec![
                pb::NodeStatus {
                    node_id: 1,
                    api_addr: "127.0.0.11:7201".into(),
                    raft_addr: "127.0.0.11:7101".into(),
                    voter: true,
                    matched_index: 42,
                    reach: pb::MemberReach::Self_ as i32,
                    ..Default::default()
                },
                pb::NodeStatus {
                    node_id: 2,
                    api_addr: "127.0.0.12:7202".into(),
                    raft_addr: "127.0.0.12:7102".into(),
                    voter: true,
                    matched_index: 40,
                    lag_entries: 2,
                    reach: pb::MemberReach::Unreachable as i32,
                    last_heard_ms_ago: 31_200,
                },
            ],
            ..Default::default()
        };
        let html = render_overview(
            &frame(1, 1),
            &s,
            &Counts::of(&table()),
            &[("PARKED", 2, "/console/sagas?state=parked".into())],
        );
        assert!(
            html.contains("PARKED: waiting for an operator")
                && html.contains("href=\"/console/sagas?state=parked\">2</a>"),
            "{html}"
        );
        for want in [
            "<meta http-equiv=\"refresh\" content=\"5\">",
            "<span class=\"ok\">SERVING</span>",
            "<td>1 (leader) (this node)</td>",
            "127.0.0.12:7202",
            "<span class=\"bad\">unreachable</span> (31.2s ago)",
            "<td class=\"n\">2</td>",
            "<td>PREPARING</td><td class=\"n\"><a href=\"/console/transactions?state=preparing\">2</a>",
            "<a href=\"/console/in-doubt\">3</a>",
        ] {
            assert!(html.contains(want), "{want:?} missing from {html}");
        }
        let follower = Frame {
            role: "Follower".into(),
            ..frame(2, 1)
        };
        let s2 = pb::ClusterStatusResponse {
            role: "Follower".into(),
            node_id: 2,
            serving: false,
            not_serving_reason: "no message from leader 1 for 900 ms".into(),
            ..s
        };
        let html = render_overview(&follower, &s2, &Counts::default(), &[]);
        assert!(
            html.contains("NOT SERVING</span>: no message from leader 1 for 900 ms"),
            "{html}"
        );
        assert!(html.contains("known on the leader only"), "{html}");
        assert!(html.contains("<td class=\"n\">?</td>"), "{html}");
    }
}
