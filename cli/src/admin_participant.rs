//! `coordinator admin participant`: a participant's own view of its
//! transactions (`ParticipantService.Inspect`), asked of the participant
//! service directly (not of the cluster). For an operator explaining a
//! stuck transaction: what the participant's durable log holds for a txid
//! (PREPARED YES / READ_ONLY, COMMITTED, ABORTED, a tombstone, with the
//! term it saw and when), the transactions it holds in doubt (voted YES,
//! decision unknown: its locks are held), and its most recent records.
//! Read-only: the participant records nothing (not even a tombstone for a
//! txid it never saw).
//!
//! A table by default, one JSON document with `--json`. Exit codes as the
//! other admin commands (cli/src/admin.rs): 0 answered, 1 another error,
//! 3 refused (a limit, not authorised, a participant too old to answer),
//! 5 unreachable (no answer in time). Reads have no unknown outcome.

use std::sync::Arc;
use std::time::Duration;

use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_client::ParticipantServiceClient;
use serde_json::json;
use serde_json::Value;

use crate::admin_view::span;
use crate::admin_view::utc;
use crate::admin_view::Table;
use crate::exit_codes::EXIT_ERROR;
use crate::exit_codes::EXIT_REFUSED;
use crate::exit_codes::EXIT_UNREACHABLE;
use crate::exit_codes::EXIT_USAGE;

/// `admin participant`: ask one participant service what its log holds.
#[derive(clap::Args)]
pub struct ParticipantArgs {
    /// The participant service's address (host:port), as enlisted.
    #[arg(long)]
    address: String,
    /// Look up this transaction (repeat, or comma-separated; at most 1000).
    #[arg(long = "txid", value_delimiter = ',')]
    txids: Vec<u64>,
    /// The cluster incarnation the `--txid`s were handed out in, in hex
    /// (as `admin status` and the listings here show it;
    /// docs/adr/0033-cluster-incarnations.md): a participant keys its
    /// records by (incarnation, txid). 0, the default: a txid of a
    /// cluster from before incarnations.
    #[arg(long, value_name = "HEX", value_parser = parse_incarnation, default_value = "0")]
    incarnation: u64,
    /// List the transactions it holds in doubt (voted YES, decision
    /// unknown: locks held), oldest first. The default when nothing else
    /// is asked.
    #[arg(long)]
    in_doubt: bool,
    /// List its N most recent records, newest first (at most 1000).
    #[arg(long, value_name = "N")]
    recent: Option<u32>,
}

/// Runs `admin participant`; `Err((exit code, one line for stderr))`.
pub async fn run(
    args: ParticipantArgs,
    json: bool,
    timeout: Duration,
    tls: Option<Arc<dtx_tls::ClientTls>>,
    token: Option<String>,
) -> Result<(), (i32, String)> {
    let addr = args.address.clone();
    let nothing_asked = args.txids.is_empty() && !args.in_doubt && args.recent.unwrap_or(0) == 0;
    let req = pb::InspectParticipantRequest {
        txids: args.txids,
        in_doubt: args.in_doubt || nothing_asked,
        recent: args.recent.unwrap_or(0),
        incarnation: args.incarnation,
    };
    let ch = dtx_transport::channel::channel_with(&addr, None, timeout.min(Duration::from_secs(2)), tls.as_ref())
        .map_err(|e| (EXIT_USAGE, format!("--address {addr}: {e}")))?;
    let rq = dtx_client::request_with_token(req, token.as_deref());
    let r = match tokio::time::timeout(timeout, ParticipantServiceClient::new(ch).inspect(rq)).await {
        Ok(Ok(r)) => r.into_inner(),
        Ok(Err(s)) => return Err(status_failure(&addr, &s)),
        Err(_) => {
            return Err((
                EXIT_UNREACHABLE,
                format!("{addr}: no answer within {timeout:?} (nothing was changed there: Inspect only reads)"),
            ))
        }
    };
    if json {
        outln!("{}", serde_json::to_string_pretty(&to_json(&addr, &r)).expect("JSON"));
    } else {
        outln!("{}", to_text(&addr, &r));
    }
    Ok(())
}

/// An incarnation as given on the command line: hex digits, `0x` allowed.
pub(crate) fn parse_incarnation(s: &str) -> Result<u64, String> {
    let digits = s.strip_prefix("0x").unwrap_or(s);
    u64::from_str_radix(digits, 16).map_err(|e| format!("{s:?} is not an incarnation in hex: {e}"))
}

/// An incarnation as shown: 16 hex digits, or `-` for 0 (none).
fn incarnation_text(i: u64) -> String {
    if i == 0 {
        "-".into()
    } else {
        format!("{i:016x}")
    }
}

/// The exit code and line for a participant's refusal or failure.
fn status_failure(addr: &str, s: &tonic::Status) -> (i32, String) {
    use tonic::Code;
    let code = match s.code() {
        Code::InvalidArgument
        | Code::NotFound
        | Code::FailedPrecondition
        | Code::Unimplemented
        | Code::Unauthenticated
        | Code::PermissionDenied
        | Code::OutOfRange => EXIT_REFUSED,
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => EXIT_UNREACHABLE,
        _ => EXIT_ERROR,
    };
    let hint = match s.code() {
        Code::Unimplemented => " (this participant's SDK predates Inspect)",
        Code::PermissionDenied | Code::Unauthenticated => {
            " (Inspect takes a node's or an operator's certificate, or the participant's node token)"
        }
        _ => "",
    };
    (
        code,
        format!("{addr}: {:?}: {}{hint}", s.code(), dtx_client::describe(s)),
    )
}

fn record_name(v: i32) -> &'static str {
    match pb::LocalRecord::try_from(v) {
        Ok(pb::LocalRecord::None) => "NONE",
        Ok(pb::LocalRecord::PreparedYes) => "PREPARED_YES",
        Ok(pb::LocalRecord::PreparedReadOnly) => "PREPARED_READ_ONLY",
        Ok(pb::LocalRecord::Committed) => "COMMITTED",
        Ok(pb::LocalRecord::Aborted) => "ABORTED",
        Ok(pb::LocalRecord::Tombstone) => "TOMBSTONE",
        Ok(pb::LocalRecord::Unspecified) | Err(_) => "UNSPECIFIED",
    }
}

/// The vote a record tells of; `None` when it does not say.
fn vote_name(v: i32) -> Option<&'static str> {
    match pb::Vote::try_from(v) {
        Ok(pb::Vote::Yes) => Some("YES"),
        Ok(pb::Vote::No) => Some("NO"),
        Ok(pb::Vote::ReadOnly) => Some("READ_ONLY"),
        Ok(pb::Vote::Unspecified) | Err(_) => None,
    }
}

fn record_json(r: &pb::ParticipantRecord, now_ms: u64) -> Value {
    let at = (r.recorded_unix_ms > 0).then_some(r.recorded_unix_ms);
    json!({
        "txid": r.txid,
        "incarnation": format!("{:016x}", r.incarnation),
        "state": record_name(r.record),
        "vote": vote_name(r.vote),
        "term": r.term,
        "recorded_unix_ms": at,
        "age_ms": at.map(|t| now_ms.saturating_sub(t)),
        "in_doubt": r.in_doubt,
    })
}

fn to_json(addr: &str, r: &pb::InspectParticipantResponse) -> Value {
    let list = |v: &[pb::ParticipantRecord]| v.iter().map(|x| record_json(x, r.now_unix_ms)).collect::<Vec<_>>();
    json!({
        "participant_id": r.participant_id,
        "address": addr,
        "now_unix_ms": r.now_unix_ms,
        "in_doubt_count": r.in_doubt_count,
        "records_total": r.records_total,
        "oldest_in_doubt_age_ms": r.oldest_in_doubt_age_ms,
        "records": list(&r.records),
        "in_doubt": list(&r.in_doubt),
        "recent": list(&r.recent),
    })
}

fn table(v: &[pb::ParticipantRecord], now_ms: u64) -> String {
    let mut t = Table::new(&[
        "TXID",
        "INCARNATION",
        "STATE",
        "VOTE",
        "TERM",
        "RECORDED",
        "AGE",
        "IN DOUBT",
    ]);
    for r in v {
        t.row(vec![
            r.txid.to_string(),
            incarnation_text(r.incarnation),
            record_name(r.record).to_string(),
            vote_name(r.vote).unwrap_or("-").to_string(),
            r.term.to_string(),
            utc(r.recorded_unix_ms),
            if r.recorded_unix_ms > 0 {
                span(now_ms.saturating_sub(r.recorded_unix_ms))
            } else {
                "-".into()
            },
            if r.in_doubt { "yes (locks held)" } else { "no" }.to_string(),
        ]);
    }
    t.render()
}

fn to_text(addr: &str, r: &pb::InspectParticipantResponse) -> String {
    let mut out = format!(
        "participant {} at {addr} (its clock {}): {} records, {} in doubt",
        r.participant_id,
        utc(r.now_unix_ms),
        r.records_total,
        r.in_doubt_count
    );
    if r.in_doubt_count > 0 {
        out.push_str(&format!(", the oldest for {}", span(r.oldest_in_doubt_age_ms)));
    }
    if !r.records.is_empty() {
        out.push_str("\n\nasked:\n");
        out.push_str(&table(&r.records, r.now_unix_ms));
    }
    if !r.in_doubt.is_empty() {
        out.push_str("\n\nin doubt (voted YES, decision unknown), oldest first:\n");
        out.push_str(&table(&r.in_doubt, r.now_unix_ms));
        if (r.in_doubt.len() as u64) < r.in_doubt_count {
            out.push_str(&format!(
                "\n({} more not listed)",
                r.in_doubt_count - r.in_doubt.len() as u64
            ));
        }
    }
    if !r.recent.is_empty() {
        out.push_str("\n\nmost recent, newest first:\n");
        out.push_str(&table(&r.recent, r.now_unix_ms));
    }
    out
}
