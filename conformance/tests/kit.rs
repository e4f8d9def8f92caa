//! The kit against a participant written here from docs/protocol.md alone
//! (in memory, no SDK): with no defect every rule passes; with one defect
//! switched on, the rules that check that part of the protocol fail, and
//! the report says what was sent and received. So a rule is never a check
//! that cannot fail. (The kit against the real bank, on its own store and
//! on PostgreSQL: devtools/tests/it/t125_conformance.rs.)

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use dtx_conformance::service::Pending;
use dtx_conformance::Effect;
use dtx_conformance::Profile;
use dtx_conformance::Service;
use dtx_conformance::Target;
use dtx_conformance::Verdict;
use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_server::ParticipantService;
use dtx_proto::v1::participant_service_server::ParticipantServiceServer;
use pb::LocalRecord as Rec;
use tonic::Request;
use tonic::Response;
use tonic::Status;

const ID: &str = "memory";

/// What the participant gets wrong.
#[derive(Clone, Copy, Default)]
struct Defects {
    /// Applies the work on every Commit, not once.
    double_apply: bool,
    /// Records nothing for an Abort before any Prepare.
    no_tombstone: bool,
    /// Ignores terms altogether.
    no_fencing: bool,
    /// Runs the work again on a repeated Prepare (and votes what it says).
    reprepare: bool,
    /// Does not serve ApplyDecisions, PrepareMany or Inspect.
    minimal: bool,
    /// Answers YES before the vote is on its disk (it gets there with
    /// the next message).
    vote_before_durable: bool,
}

#[derive(Clone, Copy, PartialEq)]
enum State {
    Yes,
    ReadOnly,
    Committed,
    Aborted,
    Tombstone,
}

#[derive(Clone)]
struct Record {
    state: State,
    term: u64,
    delta: i64,
}

#[derive(Default, Clone)]
struct Log {
    records: HashMap<(u64, u64), Record>,
    floor: HashMap<u64, u64>,
    /// The effect: the sum of committed deltas.
    total: i64,
}

/// The participant: what it serves from (`log`) and what survives a
/// crash (`disk`, a copy of `log` taken before each answer).
struct Memory {
    log: Mutex<Log>,
    disk: Mutex<Log>,
    /// Killed: every call fails until it is started again.
    dead: std::sync::atomic::AtomicBool,
    defects: Defects,
}

/// The work of a payload: `+N` votes YES with delta N, `ro` READ_ONLY,
/// anything else NO.
fn work(payload: &[u8]) -> Option<Option<i64>> {
    let s = std::str::from_utf8(payload).ok()?;
    if s == "ro" {
        return Some(None);
    }
    s.strip_prefix('+')?.parse().ok().map(Some)
}

fn refuse(kind: &'static str) -> Status {
    let mut s = Status::failed_precondition(kind);
    s.metadata_mut().insert("x-dtx-refusal", kind.parse().unwrap());
    s
}

fn wrong_id(id: &str) -> Result<(), Status> {
    if id.is_empty() || id == ID {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!("this is {ID}, not {id}")))
    }
}

impl Memory {
    fn new(defects: Defects) -> Memory {
        Memory {
            log: Mutex::new(Log::default()),
            disk: Mutex::new(Log::default()),
            dead: Default::default(),
            defects,
        }
    }

    /// Fails the call of a killed participant.
    fn alive(&self) -> Result<(), Status> {
        if self.dead.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Status::unavailable("killed"));
        }
        Ok(())
    }

    /// Writes what it serves to its disk (before answering).
    fn persist(&self) {
        let log = self.log.lock().unwrap();
        *self.disk.lock().unwrap() = log.clone();
    }

    /// A crash: what was not on its disk is gone.
    fn crash(&self) {
        self.dead.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut log = self.log.lock().unwrap();
        *log = self.disk.lock().unwrap().clone();
    }

    /// Fencing: a message of `term` for the record `key` (or, without a
    /// record, against the floor when `floor_applies`).
    fn stale(&self, log: &Log, key: (u64, u64), term: u64, floor_applies: bool) -> bool {
        if self.defects.no_fencing {
            return false;
        }
        match log.records.get(&key) {
            Some(r) => term < r.term,
            None => floor_applies && term < log.floor.get(&key.0).copied().unwrap_or(0),
        }
    }

    fn raise(&self, log: &mut Log, key: (u64, u64), term: u64) {
        if let Some(r) = log.records.get_mut(&key) {
            r.term = r.term.max(term);
        }
        let f = log.floor.entry(key.0).or_default();
        *f = (*f).max(term);
    }

    fn prepare(&self, rq: &pb::PrepareRequest) -> Result<pb::Vote, Status> {
        wrong_id(&rq.participant_id)?;
        let key = (rq.incarnation, rq.txid);
        let mut log = self.log.lock().unwrap();
        if self.stale(&log, key, rq.term, true) {
            return Err(refuse("stale-term"));
        }
        if let Some(r) = log.records.get(&key) {
            if !self.defects.reprepare || r.state != State::Yes {
                let vote = match r.state {
                    State::Yes | State::Committed => pb::Vote::Yes,
                    State::ReadOnly => pb::Vote::ReadOnly,
                    State::Aborted | State::Tombstone => pb::Vote::No,
                };
                self.raise(&mut log, key, rq.term);
                return Ok(vote);
            }
        }
        let (state, delta, vote) = match work(&rq.payload) {
            Some(Some(d)) => (State::Yes, d, pb::Vote::Yes),
            Some(None) => (State::ReadOnly, 0, pb::Vote::ReadOnly),
            None => (State::Aborted, 0, pb::Vote::No),
        };
        log.records.insert(
            key,
            Record {
                state,
                term: rq.term,
                delta,
            },
        );
        self.raise(&mut log, key, rq.term);
        Ok(vote)
    }

    fn decide(&self, incarnation: u64, txid: u64, term: u64, commit: bool) -> Result<(), Status> {
        let key = (incarnation, txid);
        let mut log = self.log.lock().unwrap();
        if self.stale(&log, key, term, false) {
            return Err(refuse("stale-term"));
        }
        let Some(r) = log.records.get_mut(&key) else {
            if commit {
                return Err(refuse("commit-without-prepare"));
            }
            if !self.defects.no_tombstone {
                log.records.insert(
                    key,
                    Record {
                        state: State::Tombstone,
                        term,
                        delta: 0,
                    },
                );
                self.raise(&mut log, key, term);
            }
            return Ok(());
        };
        let apply = match (r.state, commit) {
            (State::Yes, true) => {
                r.state = State::Committed;
                Some(r.delta)
            }
            (State::Yes, false) => {
                r.state = State::Aborted;
                None
            }
            (State::Committed, true) if self.defects.double_apply => Some(r.delta),
            (State::Committed, true) | (State::Aborted | State::Tombstone, false) | (State::ReadOnly, _) => None,
            (State::Committed, false) => return Err(refuse("abort-after-commit")),
            (State::Aborted | State::Tombstone, true) => return Err(refuse("commit-after-abort")),
        };
        if let Some(d) = apply {
            log.total += d;
        }
        self.raise(&mut log, key, term);
        Ok(())
    }

    fn one_phase(&self, rq: &pb::PrepareRequest) -> Result<bool, Status> {
        let key = (rq.incarnation, rq.txid);
        let known = self.log.lock().unwrap().records.get(&key).map(|r| r.state);
        match known {
            Some(State::Committed | State::ReadOnly) => {
                self.prepare(rq)?;
                Ok(true)
            }
            Some(State::Aborted | State::Tombstone) => {
                self.prepare(rq)?;
                Ok(false)
            }
            Some(State::Yes) | None => match self.prepare(rq)? {
                pb::Vote::Yes => self.decide(rq.incarnation, rq.txid, rq.term, true).map(|_| true),
                pb::Vote::ReadOnly => {
                    let mut log = self.log.lock().unwrap();
                    log.records.get_mut(&key).unwrap().state = State::Committed;
                    Ok(true)
                }
                _ => Ok(false),
            },
        }
    }

    fn record(&self, incarnation: u64, txid: u64) -> pb::ParticipantRecord {
        let log = self.log.lock().unwrap();
        let (record, vote, term) = match log.records.get(&(incarnation, txid)) {
            None => (Rec::None, pb::Vote::Unspecified, 0),
            Some(r) => match r.state {
                State::Yes => (Rec::PreparedYes, pb::Vote::Yes, r.term),
                State::ReadOnly => (Rec::PreparedReadOnly, pb::Vote::ReadOnly, r.term),
                State::Committed => (Rec::Committed, pb::Vote::Yes, r.term),
                State::Aborted => (Rec::Aborted, pb::Vote::Unspecified, r.term),
                State::Tombstone => (Rec::Tombstone, pb::Vote::Unspecified, r.term),
            },
        };
        pb::ParticipantRecord {
            txid,
            record: record as i32,
            vote: vote as i32,
            term,
            recorded_unix_ms: 0,
            in_doubt: record == Rec::PreparedYes,
            incarnation,
        }
    }
}

fn item_result(r: Result<(), Status>) -> pb::DecisionItemResult {
    match r {
        Ok(()) => pb::DecisionItemResult {
            applied: true,
            ..Default::default()
        },
        Err(s) => pb::DecisionItemResult {
            applied: false,
            code: s.code() as i32,
            refusal: s
                .metadata()
                .get("x-dtx-refusal")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string(),
            message: s.message().to_string(),
        },
    }
}

/// The service around the shared log (the test reads its effect too).
struct Served(Arc<Memory>);

impl std::ops::Deref for Served {
    type Target = Memory;
    fn deref(&self) -> &Memory {
        &self.0
    }
}

#[tonic::async_trait]
impl ParticipantService for Served {
    async fn prepare(&self, req: Request<pb::PrepareRequest>) -> Result<Response<pb::PrepareResponse>, Status> {
        self.alive()?;
        let vote = Memory::prepare(self, req.get_ref())?;
        if !(self.defects.vote_before_durable && vote == pb::Vote::Yes) {
            self.persist();
        }
        Ok(Response::new(pb::PrepareResponse {
            vote: vote as i32,
            reason: String::new(),
        }))
    }

    async fn commit(
        &self,
        req: Request<pb::ParticipantDecisionRequest>,
    ) -> Result<Response<pb::ParticipantDecisionResponse>, Status> {
        self.decision(req.into_inner(), true)
    }

    async fn abort(
        &self,
        req: Request<pb::ParticipantDecisionRequest>,
    ) -> Result<Response<pb::ParticipantDecisionResponse>, Status> {
        self.decision(req.into_inner(), false)
    }

    async fn commit_one_phase(
        &self,
        req: Request<pb::PrepareRequest>,
    ) -> Result<Response<pb::OnePhaseResponse>, Status> {
        self.alive()?;
        let committed = self.one_phase(req.get_ref())?;
        self.persist();
        Ok(Response::new(pb::OnePhaseResponse {
            committed,
            reason: String::new(),
        }))
    }

    async fn inquire(&self, req: Request<pb::InquireRequest>) -> Result<Response<pb::InquireResponse>, Status> {
        self.alive()?;
        let r = req.into_inner();
        let rec = self.record(r.incarnation, r.txid);
        Ok(Response::new(pb::InquireResponse {
            record: rec.record,
            term: rec.term,
        }))
    }

    async fn apply_decisions(
        &self,
        req: Request<pb::ApplyDecisionsRequest>,
    ) -> Result<Response<pb::ApplyDecisionsResponse>, Status> {
        self.alive()?;
        if self.defects.minimal {
            return Err(Status::unimplemented("not served"));
        }
        let results = req
            .into_inner()
            .items
            .iter()
            .map(|i| item_result(self.item(i)))
            .collect();
        self.persist();
        Ok(Response::new(pb::ApplyDecisionsResponse { results }))
    }

    async fn prepare_many(
        &self,
        req: Request<pb::PrepareManyRequest>,
    ) -> Result<Response<pb::PrepareManyResponse>, Status> {
        self.alive()?;
        if self.defects.minimal {
            return Err(Status::unimplemented("not served"));
        }
        let rq = req.into_inner();
        let decision_results = rq.decisions.iter().map(|i| item_result(self.item(i))).collect();
        let results = rq
            .items
            .iter()
            .map(|i| match Memory::prepare(self, i) {
                Ok(v) => pb::PrepareItemResult {
                    vote: v as i32,
                    ..Default::default()
                },
                Err(s) => {
                    let r = item_result(Err(s));
                    pb::PrepareItemResult {
                        vote: 0,
                        reason: String::new(),
                        code: r.code,
                        refusal: r.refusal,
                        message: r.message,
                    }
                }
            })
            .collect();
        self.persist();
        Ok(Response::new(pb::PrepareManyResponse {
            results,
            decision_results,
        }))
    }

    async fn inspect(
        &self,
        req: Request<pb::InspectParticipantRequest>,
    ) -> Result<Response<pb::InspectParticipantResponse>, Status> {
        if self.defects.minimal {
            return Err(Status::unimplemented("not served"));
        }
        let r = req.into_inner();
        let records = r.txids.iter().map(|&t| self.record(r.incarnation, t)).collect();
        let keys: Vec<(u64, u64)> = {
            let log = self.log.lock().unwrap();
            log.records
                .iter()
                .filter(|(_, v)| v.state == State::Yes)
                .map(|(k, _)| *k)
                .collect()
        };
        let in_doubt: Vec<pb::ParticipantRecord> = keys.iter().map(|&(i, t)| self.record(i, t)).collect();
        Ok(Response::new(pb::InspectParticipantResponse {
            participant_id: ID.into(),
            records,
            in_doubt_count: in_doubt.len() as u64,
            in_doubt,
            ..Default::default()
        }))
    }
}

impl Memory {
    /// A Commit (`commit`) or Abort call, made durable before the ack.
    fn decision(
        &self,
        r: pb::ParticipantDecisionRequest,
        commit: bool,
    ) -> Result<Response<pb::ParticipantDecisionResponse>, Status> {
        self.alive()?;
        wrong_id(&r.participant_id)?;
        self.decide(r.incarnation, r.txid, r.term, commit)?;
        self.persist();
        Ok(Response::new(pb::ParticipantDecisionResponse { applied: true }))
    }

    fn item(&self, i: &pb::DecisionItem) -> Result<(), Status> {
        wrong_id(&i.participant_id)?;
        match pb::DecisionOutcome::try_from(i.outcome) {
            Ok(pb::DecisionOutcome::Commit) => self.decide(i.incarnation, i.txid, i.term, true),
            Ok(pb::DecisionOutcome::Abort) => self.decide(i.incarnation, i.txid, i.term, false),
            _ => Err(Status::invalid_argument("no outcome")),
        }
    }
}

struct Total(Arc<Memory>);

impl Effect for Total {
    fn read(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<i64, String>> + Send + '_>> {
        let v = self.0.log.lock().unwrap().total;
        Box::pin(async move { Ok(v) })
    }
}

/// The participant as a service the kit can crash: its server task on a
/// fixed address, stopped (and what was not on its disk lost) by `kill`.
struct InProcess {
    memory: Arc<Memory>,
    addr: std::net::SocketAddr,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Service for InProcess {
    fn start(&self) -> Pending<'_, Result<(), String>> {
        Box::pin(async move {
            let listener = loop {
                match tokio::net::TcpListener::bind(self.addr).await {
                    Ok(l) => break l,
                    Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                        tokio::time::sleep(Duration::from_millis(20)).await
                    }
                    Err(e) => return Err(e.to_string()),
                }
            };
            self.memory.dead.store(false, std::sync::atomic::Ordering::SeqCst);
            let server = tonic::transport::Server::builder()
                .add_service(ParticipantServiceServer::new(Served(self.memory.clone())))
                .serve_with_incoming(dtx_tls::incoming(listener, None));
            let task = tokio::spawn(async move {
                let _ = server.await;
            });
            *self.task.lock().unwrap() = Some(task);
            Ok(())
        })
    }

    fn kill(&self) -> Pending<'_, Result<(), String>> {
        Box::pin(async move {
            self.memory.crash();
            if let Some(t) = self.task.lock().unwrap().take() {
                t.abort();
            }
            Ok(())
        })
    }
}

/// Serves a participant with `defects` and runs the whole kit against it,
/// crash rules included.
async fn kit_against(defects: Defects) -> dtx_conformance::Report {
    let memory = Arc::new(Memory::new(defects));
    let addr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    let service = Arc::new(InProcess {
        memory: memory.clone(),
        addr,
        task: Mutex::new(None),
    });
    service.start().await.unwrap();
    let target = Target {
        address: addr.to_string(),
        participant_id: ID.into(),
        tls: None,
        token: None,
        call_timeout: Duration::from_secs(5),
    };
    let profile = Profile {
        yes_payload: b"+1".to_vec(),
        no_payload: Some(b"refuse".to_vec()),
        read_only_payload: Some(b"ro".to_vec()),
        effect: Some(Arc::new(Total(memory.clone()))),
        effect_per_commit: 1,
    };
    let report = dtx_conformance::run(&target, &profile, &[], Some(service.clone())).await;
    service.kill().await.unwrap();
    report
}

/// The rules that did not pass, with their verdicts.
fn not_passed(r: &dtx_conformance::Report) -> Vec<(&'static str, Verdict)> {
    r.rules
        .iter()
        .filter(|x| x.verdict != Verdict::Passed)
        .map(|x| (x.id, x.verdict))
        .collect()
}

#[tokio::test]
async fn a_participant_that_keeps_the_protocol_passes_every_rule() {
    let r = kit_against(Defects::default()).await;
    assert!(not_passed(&r).is_empty(), "{}", r.to_text());
    assert_eq!(r.count(Verdict::Passed), dtx_conformance::RULES.len());
    assert_eq!(r.exit_status(), 0);
}

#[tokio::test]
async fn a_repeated_commit_applied_twice_fails_the_exactly_once_rules() {
    let r = kit_against(Defects {
        double_apply: true,
        ..Defects::default()
    })
    .await;
    let failed = not_passed(&r);
    assert!(
        failed.contains(&("effect.commit-once", Verdict::Failed)),
        "{}",
        r.to_text()
    );
    assert!(
        failed.contains(&("effect.one-phase-once", Verdict::Failed)),
        "{}",
        r.to_text()
    );
    // Only the rules that count effects see it (some across a crash): the
    // acks are all right.
    assert!(
        failed
            .iter()
            .all(|(id, _)| id.starts_with("effect.") || id.starts_with("crash.")),
        "{}",
        r.to_text()
    );
    let rule = r.rule("effect.commit-once").unwrap();
    assert!(rule.detail.contains("moved by 3"), "{}", rule.detail);
    assert!(
        rule.transcript.iter().any(|l| l.starts_with("Commit(txid")),
        "{:?}",
        rule.transcript
    );
    assert_eq!(r.exit_status(), dtx_conformance::report::EXIT_FAILED);
}

#[tokio::test]
async fn an_abort_without_a_tombstone_fails_the_tombstone_rules() {
    let r = kit_against(Defects {
        no_tombstone: true,
        ..Defects::default()
    })
    .await;
    let failed: Vec<&str> = not_passed(&r).into_iter().map(|(id, _)| id).collect();
    for id in [
        "abort.before-prepare",
        "incarnation.separate",
        "fence.term-floor",
        "apply-decisions",
    ] {
        assert!(failed.contains(&id), "{id} should fail:\n{}", r.to_text());
    }
    // A late Prepare after the lost tombstone prepares the work: the
    // effect rule sees it voted YES where NO was due.
    assert!(failed.contains(&"effect.abort-nothing"), "{}", r.to_text());
    assert!(!failed.contains(&"commit.repeat"), "{}", r.to_text());
}

#[tokio::test]
async fn a_participant_without_fencing_fails_the_fencing_rules() {
    let r = kit_against(Defects {
        no_fencing: true,
        ..Defects::default()
    })
    .await;
    let failed: Vec<&str> = not_passed(&r).into_iter().map(|(id, _)| id).collect();
    for id in [
        "fence.phase-two",
        "fence.raised",
        "fence.term-floor",
        "effect.stale-nothing",
    ] {
        assert!(failed.contains(&id), "{id} should fail:\n{}", r.to_text());
    }
    assert!(!failed.contains(&"prepare.yes"), "{}", r.to_text());
}

#[tokio::test]
async fn a_repeated_prepare_that_runs_the_work_again_fails_the_repeat_rule() {
    let r = kit_against(Defects {
        reprepare: true,
        ..Defects::default()
    })
    .await;
    let failed: Vec<&str> = not_passed(&r).into_iter().map(|(id, _)| id).collect();
    assert!(failed.contains(&"prepare.repeat"), "{}", r.to_text());
    let rule = r.rule("prepare.repeat").unwrap();
    assert!(rule.detail.contains("answered NO"), "{}", rule.detail);
}

#[tokio::test]
async fn a_yes_answered_before_it_is_durable_fails_the_crash_rules() {
    let r = kit_against(Defects {
        vote_before_durable: true,
        ..Defects::default()
    })
    .await;
    let failed: Vec<&str> = not_passed(&r).into_iter().map(|(id, _)| id).collect();
    assert!(failed.contains(&"crash.after-yes"), "{}", r.to_text());
    assert!(failed.contains(&"crash.in-recovery"), "{}", r.to_text());
    // Without a crash nothing shows: every other rule passes.
    assert!(failed.iter().all(|id| id.starts_with("crash.")), "{}", r.to_text());
    let rule = r.rule("crash.after-yes").unwrap();
    assert!(rule.detail.contains("answered NONE"), "{}", rule.detail);
    assert!(
        rule.transcript.iter().any(|l| l.starts_with("kill -9")),
        "{:?}",
        rule.transcript
    );
}

#[tokio::test]
async fn optional_calls_not_served_are_skipped_not_failed() {
    let r = kit_against(Defects {
        minimal: true,
        ..Defects::default()
    })
    .await;
    assert_eq!(
        not_passed(&r),
        vec![
            ("apply-decisions", Verdict::Skipped),
            ("prepare-many", Verdict::Skipped),
            ("inspect", Verdict::Skipped)
        ],
        "{}",
        r.to_text()
    );
    assert_eq!(r.exit_status(), 0);
}

#[tokio::test]
async fn a_participant_that_does_not_answer_is_unknown_not_failed() {
    // A listener that accepts and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((c, _)) = listener.accept().await {
            conns.push(c);
        }
    });
    let target = Target {
        address: addr.to_string(),
        participant_id: ID.into(),
        tls: None,
        token: None,
        call_timeout: Duration::from_millis(300),
    };
    let profile = Profile {
        yes_payload: b"+1".to_vec(),
        no_payload: None,
        read_only_payload: None,
        effect: None,
        effect_per_commit: 1,
    };
    let r = dtx_conformance::run(&target, &profile, &["prepare.yes".into(), "commit.".into()], None).await;
    held.abort();
    assert_eq!(r.rules.len(), 3, "{}", r.to_text());
    assert!(r.rules.iter().all(|x| x.verdict == Verdict::Unknown), "{}", r.to_text());
    assert_eq!(r.exit_status(), dtx_conformance::report::EXIT_UNKNOWN);
}
