//! One rule's conversation with the participant: every call it makes, with
//! what was sent and what came back, kept for the report. The calls answer
//! `Reply`: an answer, a status (a refusal is a status), or no answer in
//! time (unknown: the kit never counts a timeout as a failure of the
//! participant, nor as a pass).

use std::sync::Arc;
use std::time::Duration;

use dtx_proto::metadata::REFUSAL_HEADER;
use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_client::ParticipantServiceClient;
use dtx_transport::channel::Channel;
use tonic::Code;

use crate::profile::Target;

/// What one call came back with.
#[derive(Debug)]
pub enum Reply<T> {
    /// An answer.
    Answer(T),
    /// A status: its code, the refusal kind under `x-dtx-refusal` (empty
    /// when absent) and the message.
    Status {
        code: Code,
        refusal: String,
        message: String,
    },
    /// No answer within the call timeout: whether it was applied is not
    /// known.
    NoAnswer,
}

/// Why a rule stopped: the participant broke the rule, or an answer did
/// not come (the rule's outcome is unknown).
#[derive(Debug)]
pub enum Stop {
    /// The participant answered what the rule forbids.
    Broken(String),
    /// A call got no answer in time, or the connection failed.
    Unknown(String),
}

/// A rule's steps return this; `?` carries a `Stop` out of the rule.
pub type Step<T> = Result<T, Stop>;

/// Ends the rule as broken with `why`.
pub fn broken<T>(why: impl Into<String>) -> Step<T> {
    Err(Stop::Broken(why.into()))
}

/// A transaction as the kit names it: one incarnation of its own (so no
/// transaction of a real cluster is touched) and a txid.
#[derive(Clone, Copy, Debug)]
pub struct Tx {
    pub incarnation: u64,
    pub txid: u64,
}

/// Makes the calls of one rule and keeps its transcript: every call's
/// request, with the token, bounded by the call timeout, and one line per
/// call saying what was sent and what came back.
pub struct Recorder {
    token: Option<String>,
    call_timeout: Duration,
    /// Every call so far: what was sent and what came back, one line each.
    pub transcript: Vec<String>,
}

impl Recorder {
    /// A recorder for calls to `target`.
    pub fn new(target: &Target) -> Recorder {
        Recorder {
            token: target.token.clone(),
            call_timeout: target.call_timeout,
            transcript: Vec::new(),
        }
    }

    /// `msg` as a request, with the token when there is one.
    pub fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut rq = tonic::Request::new(msg);
        if let Some(v) = self.token.as_deref().and_then(|t| format!("Bearer {t}").parse().ok()) {
            rq.metadata_mut().insert("authorization", v);
        }
        rq
    }

    /// Awaits `fut` within the call timeout and notes `sent` and what came
    /// back (`show` for an answer).
    pub async fn call<T, F>(&mut self, sent: String, fut: F, show: impl Fn(&T) -> String) -> Reply<T>
    where
        F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let reply = match tokio::time::timeout(self.call_timeout, fut).await {
            Ok(Ok(r)) => Reply::Answer(r.into_inner()),
            Ok(Err(s)) => Reply::Status {
                code: s.code(),
                refusal: s
                    .metadata()
                    .get(REFUSAL_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_string(),
                message: s.message().to_string(),
            },
            Err(_) => Reply::NoAnswer,
        };
        let got = match &reply {
            Reply::Answer(a) => show(a),
            Reply::Status { code, refusal, message } if refusal.is_empty() => format!("{code:?}: {message}"),
            Reply::Status { code, refusal, message } => format!("{code:?} (refusal {refusal}): {message}"),
            Reply::NoAnswer => format!("no answer within {:?}", self.call_timeout),
        };
        self.transcript.push(format!("{sent} -> {got}"));
        reply
    }
}

/// One rule's client of the participant and its transcript.
pub struct Session {
    client: ParticipantServiceClient<Channel>,
    participant_id: String,
    /// The calls and the transcript.
    pub rec: Recorder,
}

impl Session {
    /// A session on `target`'s connection.
    pub fn new(target: &Target, channel: Channel) -> Session {
        Session {
            client: ParticipantServiceClient::new(channel),
            participant_id: target.participant_id.clone(),
            rec: Recorder::new(target),
        }
    }

    /// The participant id the kit addresses.
    pub fn participant_id(&self) -> &str {
        &self.participant_id
    }

    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        self.rec.request(msg)
    }

    async fn call<T, F>(&mut self, sent: String, fut: F, show: impl Fn(&T) -> String) -> Reply<T>
    where
        F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        self.rec.call(sent, fut, show).await
    }

    fn prepare_request(&self, tx: Tx, term: u64, payload: &[u8]) -> pb::PrepareRequest {
        pb::PrepareRequest {
            txid: tx.txid,
            term,
            participant_id: self.participant_id.clone(),
            payload: payload.to_vec(),
            incarnation: tx.incarnation,
        }
    }

    /// Prepare with this session's participant id.
    pub async fn prepare(&mut self, tx: Tx, term: u64, payload: &[u8]) -> Reply<pb::PrepareResponse> {
        let msg = self.prepare_request(tx, term, payload);
        self.prepare_as(msg).await
    }

    /// Prepare exactly as given (another participant id, say).
    pub async fn prepare_as(&mut self, msg: pb::PrepareRequest) -> Reply<pb::PrepareResponse> {
        let sent = format!(
            "Prepare(txid {}, term {}, participant {:?}, payload {})",
            msg.txid,
            msg.term,
            msg.participant_id,
            show_payload(&msg.payload)
        );
        let rq = self.request(msg);
        let mut c = self.client.clone();
        self.call(sent, c.prepare(rq), |a: &pb::PrepareResponse| {
            show_vote(a.vote, &a.reason)
        })
        .await
    }

    /// CommitOnePhase.
    pub async fn commit_one_phase(&mut self, tx: Tx, term: u64, payload: &[u8]) -> Reply<pb::OnePhaseResponse> {
        let msg = self.prepare_request(tx, term, payload);
        let sent = format!(
            "CommitOnePhase(txid {}, term {term}, payload {})",
            tx.txid,
            show_payload(payload)
        );
        let rq = self.request(msg);
        let mut c = self.client.clone();
        self.call(sent, c.commit_one_phase(rq), |a: &pb::OnePhaseResponse| {
            if a.committed {
                "committed".to_string()
            } else {
                format!("not committed ({})", a.reason)
            }
        })
        .await
    }

    fn decision(&self, tx: Tx, term: u64) -> pb::ParticipantDecisionRequest {
        pb::ParticipantDecisionRequest {
            txid: tx.txid,
            term,
            participant_id: self.participant_id.clone(),
            incarnation: tx.incarnation,
        }
    }

    /// Commit (phase two).
    pub async fn commit(&mut self, tx: Tx, term: u64) -> Reply<pb::ParticipantDecisionResponse> {
        let rq = self.request(self.decision(tx, term));
        let mut c = self.client.clone();
        let sent = format!("Commit(txid {}, term {term})", tx.txid);
        self.call(sent, c.commit(rq), show_applied).await
    }

    /// Abort (phase two, or before any Prepare).
    pub async fn abort(&mut self, tx: Tx, term: u64) -> Reply<pb::ParticipantDecisionResponse> {
        let rq = self.request(self.decision(tx, term));
        let mut c = self.client.clone();
        let sent = format!("Abort(txid {}, term {term})", tx.txid);
        self.call(sent, c.abort(rq), show_applied).await
    }

    /// Inquire: what the durable log holds.
    pub async fn inquire(&mut self, tx: Tx) -> Reply<pb::InquireResponse> {
        let rq = self.request(pb::InquireRequest {
            txid: tx.txid,
            participant_id: self.participant_id.clone(),
            incarnation: tx.incarnation,
        });
        let mut c = self.client.clone();
        let sent = format!("Inquire(txid {})", tx.txid);
        self.call(sent, c.inquire(rq), |a: &pb::InquireResponse| {
            format!("{}, term {}", show_record(a.record), a.term)
        })
        .await
    }

    /// ApplyDecisions with `items` (txid, term, outcome).
    pub async fn apply_decisions(
        &mut self,
        incarnation: u64,
        items: &[(u64, u64, pb::DecisionOutcome)],
    ) -> Reply<pb::ApplyDecisionsResponse> {
        let items: Vec<pb::DecisionItem> = items
            .iter()
            .map(|&(txid, term, outcome)| self.decision_item(Tx { incarnation, txid }, term, outcome))
            .collect();
        let sent = format!("ApplyDecisions[{}]", show_items(&items));
        let rq = self.request(pb::ApplyDecisionsRequest { items });
        let mut c = self.client.clone();
        self.call(sent, c.apply_decisions(rq), |a: &pb::ApplyDecisionsResponse| {
            format!("[{}]", show_results(&a.results))
        })
        .await
    }

    /// A decision item for this participant.
    pub fn decision_item(&self, tx: Tx, term: u64, outcome: pb::DecisionOutcome) -> pb::DecisionItem {
        pb::DecisionItem {
            txid: tx.txid,
            term,
            participant_id: self.participant_id.clone(),
            outcome: outcome as i32,
            incarnation: tx.incarnation,
        }
    }

    /// PrepareMany with `items` (txid, term, payload) and decisions riding
    /// along.
    pub async fn prepare_many(
        &mut self,
        incarnation: u64,
        items: &[(u64, u64, &[u8])],
        decisions: Vec<pb::DecisionItem>,
    ) -> Reply<pb::PrepareManyResponse> {
        let items: Vec<pb::PrepareRequest> = items
            .iter()
            .map(|&(txid, term, payload)| self.prepare_request(Tx { incarnation, txid }, term, payload))
            .collect();
        let sent = format!(
            "PrepareMany[{}; decisions {}]",
            items
                .iter()
                .map(|i| format!("txid {} term {} {}", i.txid, i.term, show_payload(&i.payload)))
                .collect::<Vec<_>>()
                .join(", "),
            show_items(&decisions)
        );
        let rq = self.request(pb::PrepareManyRequest { items, decisions });
        let mut c = self.client.clone();
        self.call(sent, c.prepare_many(rq), |a: &pb::PrepareManyResponse| {
            let votes: Vec<String> = a
                .results
                .iter()
                .map(|r| {
                    if r.code == 0 {
                        show_vote(r.vote, &r.reason)
                    } else {
                        format!("code {} {} {}", r.code, r.refusal, r.message)
                    }
                })
                .collect();
            format!(
                "[{}; decisions {}]",
                votes.join(", "),
                show_results(&a.decision_results)
            )
        })
        .await
    }

    /// Inspect of `txids`, with the in-doubt list.
    pub async fn inspect(&mut self, incarnation: u64, txids: &[u64]) -> Reply<pb::InspectParticipantResponse> {
        let rq = self.request(pb::InspectParticipantRequest {
            txids: txids.to_vec(),
            in_doubt: true,
            recent: 0,
            incarnation,
        });
        let mut c = self.client.clone();
        let sent = format!("Inspect(txids {txids:?}, in_doubt)");
        self.call(sent, c.inspect(rq), |a: &pb::InspectParticipantResponse| {
            let recs: Vec<String> = a
                .records
                .iter()
                .map(|r| format!("{} {}", r.txid, show_record(r.record)))
                .collect();
            format!(
                "participant {:?}, records [{}], {} in doubt",
                a.participant_id,
                recs.join(", "),
                a.in_doubt.len()
            )
        })
        .await
    }

    /// Notes a line in the transcript (an effect read, say).
    pub fn note(&mut self, line: String) {
        self.rec.transcript.push(line);
    }
}

fn show_applied(a: &pb::ParticipantDecisionResponse) -> String {
    format!("applied = {}", a.applied)
}

fn show_items(items: &[pb::DecisionItem]) -> String {
    items
        .iter()
        .map(|i| {
            let o = pb::DecisionOutcome::try_from(i.outcome)
                .map(|o| o.as_str_name().trim_start_matches("DECISION_OUTCOME_").to_string())
                .unwrap_or_else(|_| i.outcome.to_string());
            format!("{o} txid {} term {}", i.txid, i.term)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn show_results(results: &[pb::DecisionItemResult]) -> String {
    results
        .iter()
        .map(|r| {
            if r.applied {
                "applied".to_string()
            } else {
                format!("code {} {} {}", r.code, r.refusal, r.message)
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A vote as the report shows it.
pub fn show_vote(vote: i32, reason: &str) -> String {
    let v = pb::Vote::try_from(vote)
        .map(|v| v.as_str_name().trim_start_matches("VOTE_").to_string())
        .unwrap_or_else(|_| format!("vote {vote}"));
    if reason.is_empty() {
        v
    } else {
        format!("{v} ({reason})")
    }
}

/// A record state as the report shows it.
pub fn show_record(record: i32) -> String {
    pb::LocalRecord::try_from(record)
        .map(|r| r.as_str_name().trim_start_matches("LOCAL_RECORD_").to_string())
        .unwrap_or_else(|_| format!("record {record}"))
}

/// A payload as the report shows it: short text as text, else its size.
pub fn show_payload(p: &[u8]) -> String {
    match std::str::from_utf8(p) {
        Ok(s) if s.len() <= 64 && !s.chars().any(char::is_control) => format!("{s:?}"),
        _ => format!("{} bytes", p.len()),
    }
}

/// A client of `target`'s participant service.
pub fn connect(target: &Target) -> Result<Channel, String> {
    dtx_transport::channel::channel_with(
        &target.address,
        None,
        target.call_timeout.min(Duration::from_secs(2)),
        target.tls.as_ref(),
    )
}

/// The TLS settings of a client, if any.
pub type ClientTls = Arc<dtx_tls::ClientTls>;
