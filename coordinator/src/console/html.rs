//! The console's HTML and URL basics, shared by every page: escaping,
//! percent-encoding, and the frame every page is drawn in (the header,
//! the banner saying which node rendered it from what, the footer).

use std::fmt::Write as _;

use dtx_common::view::utc;
use dtx_proto::v1 as pb;

/// Percent-decodes a URL component (`+` is a space, as in forms).
pub fn pct_decode(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = b
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| format!("bad percent-encoding in {s:?}"))?;
                out.push(hex);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} is not UTF-8 once decoded"))
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
pub fn pct(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// HTML-escapes text for element content and double- or single-quoted
/// attribute values. Everything that comes from data goes through it.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + s.len() / 8);
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// What every page says about where it comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Frame {
    pub cluster_id: String,
    pub node_id: u64,
    pub role: String,
    pub term: u64,
    pub applied_index: u64,
    pub serving: bool,
    pub leader_id: u64,
    pub leader_api_addr: String,
    /// The leader's console, when its HTTP address is known here (today:
    /// when this node leads; the membership carries no `metrics_addr`).
    pub leader_console: Option<String>,
    /// This node's clock when it rendered the page.
    pub now_ms: u64,
}

impl Frame {
    pub fn of(s: &pb::ClusterStatusResponse, now_ms: u64) -> Frame {
        Frame {
            cluster_id: s.cluster_id.clone(),
            node_id: s.node_id,
            role: s.role.clone(),
            term: s.term,
            applied_index: s.last_applied_index,
            serving: s.serving,
            leader_id: s.leader_id,
            leader_api_addr: s.leader_api_addr.clone(),
            leader_console: (s.leader_id != 0 && s.leader_id == s.node_id).then(|| "/console".to_string()),
            now_ms,
        }
    }

    pub(super) fn leads(&self) -> bool {
        self.leader_id != 0 && self.leader_id == self.node_id
    }

    /// "node 1 at 10.0.0.1:7201" with a link to its console when known.
    pub(super) fn leader_html(&self) -> String {
        if self.leader_id == 0 {
            return "none known (an election is under way, or this node reaches no majority)".into();
        }
        let mut s = format!("node {}", self.leader_id);
        if !self.leader_api_addr.is_empty() {
            let _ = write!(s, " at <span class=\"mono\">{}</span>", esc(&self.leader_api_addr));
        }
        if self.leads() {
            s.push_str(" (this node)");
        } else if let Some(url) = &self.leader_console {
            let _ = write!(s, " (<a href=\"{}\">its console</a>)", esc(url));
        }
        s
    }
}

const STYLE: &str = "\
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,'Liberation Sans',Arial,sans-serif;margin:0;color:#1d2330;background:#f4f5f7}\
header{background:#1f2a44;color:#fff;padding:10px 24px;display:flex;flex-wrap:wrap;gap:8px 28px;align-items:baseline}\
header b{font-size:17px}header a{color:#cfe0ff;text-decoration:none}header a:hover{text-decoration:underline}\
main{padding:14px 24px 28px;max-width:1280px}\
h1{font-size:20px;margin:6px 0 10px}h2{font-size:16px;margin:20px 0 6px}\
.banner{background:#fff8e1;border:1px solid #ecd58c;padding:7px 12px;border-radius:4px;margin:0 0 12px}\
table{border-collapse:collapse;background:#fff;margin:4px 0 12px}\
th,td{border:1px solid #dde1e7;padding:4px 10px;text-align:left;vertical-align:top}\
th{background:#eef1f5;font-weight:600;white-space:nowrap}td.n{text-align:right;font-variant-numeric:tabular-nums}\
.mono,code{font-family:ui-monospace,'DejaVu Sans Mono','Liberation Mono',monospace;font-size:13px}\
.ok{color:#0a7d32;font-weight:600}.bad{color:#b3261e;font-weight:600}.warn{color:#9a5b00;font-weight:600}\
.s{display:inline-block;padding:0 6px;border-radius:3px;font-size:12px;font-weight:600;white-space:nowrap}\
.s-active{background:#e3edff;color:#1c4fb8}.s-preparing{background:#fff0cc;color:#8a5300}\
.s-commit{background:#dcf5e3;color:#0a6b2c}.s-abort{background:#fde2e0;color:#a3231b}\
.muted{color:#5f6878}footer{color:#5f6878;font-size:12px;padding:0 24px 20px}\
nav.f a{margin-right:12px}.cols{display:flex;flex-wrap:wrap;gap:0 48px}";

/// A whole page: the header, the banner saying which node rendered it from
/// what, `body`, and the footer.
pub(super) fn page(f: &Frame, title: &str, refresh: bool, body: &str) -> String {
    let mut out = String::with_capacity(body.len() + 4096);
    out.push_str("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">");
    if refresh {
        out.push_str("<meta http-equiv=\"refresh\" content=\"5\">");
    }
    let _ = write!(
        out,
        "<title>{} · node {} · dtx {}</title><style>{STYLE}</style></head><body>",
        esc(title),
        f.node_id,
        esc(&f.cluster_id)
    );
    let _ = write!(
        out,
        "<header><b>dtx console</b><span>cluster <span class=\"mono\">{}</span> · node {}</span>\
         <a href=\"/console\">Cluster</a><a href=\"/console/transactions\">Transactions</a>\
         <a href=\"/console/in-doubt\">In doubt</a><a href=\"/console/sagas\">Sagas</a></header><main>",
        esc(&f.cluster_id),
        f.node_id
    );
    let _ = write!(
        out,
        "<p class=\"banner\" id=\"rendered-by\">Rendered by <b>node {}</b> ({}, term {}) at {} from <b>this node's \
         applied state</b> (applied index {}). ",
        f.node_id,
        esc(&f.role),
        f.term,
        utc(f.now_ms),
        f.applied_index
    );
    if f.leads() {
        out.push_str("This node is the leader.");
    } else {
        let _ = write!(
            out,
            "A follower may lag the leader by a few entries; the leader: {}.",
            f.leader_html()
        );
    }
    if !f.serving {
        out.push_str(" <span class=\"bad\">This node is NOT serving</span> (see Cluster).");
    }
    out.push_str("</p>");
    let _ = write!(out, "<h1>{}</h1>", esc(title));
    out.push_str(body);
    out.push_str(
        "</main><footer>Read-only: this console changes nothing. It is served on the node's metrics port \
         (metrics_addr), which has no authentication: keep that port on a management network \
         (console_enabled = false turns the console off).</footer></body></html>\n",
    );
    out
}
