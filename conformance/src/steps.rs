//! The rules for a saga step service (`dtx.v1.SagaStepService`,
//! docs/sagas.md "Step services"): one business change per operation id,
//! the stored reply answered again, Status that changes nothing, Fence and
//! a compensation without its forward action making "not applied"
//! permanent, fingerprints, and (for a versioned step) STALE. Each rule
//! uses a saga id of its own, so its operation ids are new to the service.

use dtx_proto::v1 as pb;
use dtx_proto::v1::saga_step_service_client::SagaStepServiceClient;
use dtx_transport::channel::Channel;
use pb::StepOutcome as Out;
use tonic::Code;

use crate::ctx::answer;
use crate::ctx::refused;
use crate::ctx::Done;
use crate::profile::Target;
use crate::report::RuleReport;
use crate::report::Verdict;
use crate::service;
use crate::service::Service;
use crate::wire::broken;
use crate::wire::show_payload;
use crate::wire::Recorder;
use crate::wire::Reply;
use crate::wire::Step;
use crate::wire::Stop;
use std::sync::Arc;

/// What the kit needs to know of the step's business.
#[derive(Clone, Debug)]
pub struct StepProfile {
    /// The forward action's name.
    pub forward_action: String,
    /// The compensation's name.
    /// The compensation's name; `None` for a step without one (a PIVOT or
    /// RETRIABLE step): the rules that compensate are skipped.
    pub compensate_action: Option<String>,
    /// The step's status query's name.
    pub status_query: String,
    /// An input the forward action answers OK on; `{saga}` in it is
    /// replaced by the rule's saga id (an order id of its own, say).
    pub input: String,
    /// An input it answers FAILED on (the rules that need one are
    /// skipped without it); `{saga}` as in `input`.
    pub failed_input: Option<String>,
    /// The compensation checks its precondition against the resource
    /// version the forward action reported (STALE otherwise).
    pub versioned: bool,
}

/// A step-service rule.
pub struct StepRule {
    pub id: &'static str,
    pub title: &'static str,
}

const SECTION: &str = "sagas.md: Step services";

/// Every step-service rule, in the order the kit runs them.
pub const STEP_RULES: &[StepRule] = &[
    StepRule { id: "step.forward-repeat", title: "a forward call runs once per operation id: a repeat answers the stored reply" },
    StepRule { id: "step.failed-repeat", title: "a forward FAILED is stored: a repeat answers FAILED again" },
    StepRule { id: "step.status-unseen", title: "Status of an unseen operation answers not applied and records nothing" },
    StepRule { id: "step.status-applied", title: "Status of a done operation answers its stored reply" },
    StepRule { id: "step.fence-unseen", title: "Fence of an unseen operation answers not applied and records it FAILED: a late forward call answers FAILED and never runs" },
    StepRule { id: "step.fence-applied", title: "Fence of a done operation answers its stored reply and changes nothing" },
    StepRule { id: "step.fingerprint", title: "a repeated operation id with another fingerprint is refused (FAILED_PRECONDITION) and changes nothing" },
    StepRule { id: "step.kind", title: "an operation id used by a forward call is refused for a compensation (FAILED_PRECONDITION)" },
    StepRule { id: "step.no-operation-id", title: "a call without an operation id is INVALID_ARGUMENT" },
    StepRule { id: "step.compensate-noop", title: "a compensation whose forward action never ran answers NOOP and fences the forward operation" },
    StepRule { id: "step.compensate-after-failed", title: "a compensation of a FAILED forward action answers NOOP" },
    StepRule { id: "step.compensate-repeat", title: "a compensation runs once per operation id: a repeat answers the stored reply" },
    StepRule { id: "step.stale", title: "a compensation whose precondition is not the resource's version answers STALE and changes nothing" },
    StepRule { id: "step.crash.after-forward", title: "a forward reply given before a kill -9 is the stored reply after the restart" },
    StepRule { id: "step.crash.in-forward", title: "killed while a forward call runs: after the restart it was done once or not at all, and a repeat completes it once" },
    StepRule { id: "step.crash.after-fence", title: "a fence survives a kill -9: a late forward call answers FAILED" },
    StepRule { id: "step.crash.after-compensate", title: "a compensation's reply given before a kill -9 is the stored reply after the restart" },
];

/// The step number the kit's calls carry.
const STEP: u32 = 1;

struct StepCx<'a> {
    client: SagaStepServiceClient<Channel>,
    rec: Recorder,
    p: &'a StepProfile,
    target: &'a Target,
    /// The service as a process the kit may kill (with `--start`).
    service: Option<Arc<dyn Service>>,
    saga: u64,
    next: u32,
}

fn show_reply(r: &pb::StepReply) -> String {
    let o = Out::try_from(r.outcome)
        .map(|o| o.as_str_name().trim_start_matches("STEP_OUTCOME_").to_string())
        .unwrap_or_else(|_| format!("outcome {}", r.outcome));
    let mut s = o;
    if !r.resource_version.is_empty() {
        s.push_str(&format!(" version {:?}", r.resource_version));
    }
    if !r.reason.is_empty() {
        s.push_str(&format!(" ({})", r.reason));
    }
    s
}

fn show_status(r: &pb::StepStatusReply) -> String {
    match (&r.reply, r.applied) {
        (Some(reply), true) => format!("applied: {}", show_reply(reply)),
        (_, applied) => format!("applied = {applied}"),
    }
}

/// The parts of a reply a repeat must answer the same.
fn same_reply(a: &pb::StepReply, b: &pb::StepReply) -> bool {
    a.outcome == b.outcome
        && a.resource_version == b.resource_version
        && a.downstream_operation_id == b.downstream_operation_id
        && a.output == b.output
        && a.residual == b.residual
}

impl StepCx<'_> {
    /// Kills the service with SIGKILL, starts it again and reconnects.
    async fn crash(&mut self, when: &str) -> Step<()> {
        let service = self.service.clone().expect("crash rules run with a service");
        service::kill(service.as_ref()).await?;
        self.rec.transcript.push(format!("kill -9 ({when})"));
        service::restart(service.as_ref()).await?;
        self.rec.transcript.push("started again on the same data".into());
        self.reconnect()
    }

    fn reconnect(&mut self) -> Step<()> {
        let channel = crate::wire::connect(self.target).map_err(Stop::Unknown)?;
        self.client = SagaStepServiceClient::new(channel);
        Ok(())
    }

    /// Sends `call` as a forward call on a connection of its own, kills
    /// the service a few milliseconds later and starts it again; what the
    /// call got.
    async fn forward_killed(&mut self, call: pb::StepCall) -> Step<Reply<pb::StepReply>> {
        let channel = crate::wire::connect(self.target).map_err(Stop::Unknown)?;
        let client = SagaStepServiceClient::new(channel);
        let mut rec = Recorder::new(self.target);
        let flight = async move {
            let r = send_forward(client, &mut rec, call).await;
            (rec, r)
        };
        let service = self.service.clone().expect("crash rules run with a service");
        let ((rec, reply), delay_us) = service::kill_during(service.as_ref(), flight).await?;
        self.rec.transcript.extend(rec.transcript);
        self.rec
            .transcript
            .push(format!("kill -9 {delay_us} us after the forward call left"));
        service::restart(service.as_ref()).await?;
        self.rec.transcript.push("started again on the same data".into());
        self.reconnect()?;
        Ok(reply)
    }

    /// A new operation id of this rule's saga.
    fn op(&mut self, kind: char) -> String {
        self.next += 1;
        format!("{}.{}.{kind}{}", self.saga, STEP, self.next)
    }

    fn input(&self, template: &str) -> Vec<u8> {
        template.replace("{saga}", &self.saga.to_string()).into_bytes()
    }

    /// The input the forward action answers OK on.
    fn ok_input(&self) -> Vec<u8> {
        self.input(&self.p.input)
    }

    /// A new forward operation done with the OK input: its operation id,
    /// the input and the OK reply.
    async fn forward_ok(&mut self) -> Step<(String, Vec<u8>, pb::StepReply)> {
        let f = self.op('f');
        let input = self.ok_input();
        let reply = self.forward_is(&f, &input, Out::Ok).await?;
        Ok((f, input, reply))
    }

    fn call(&self, op: &str, action: &str, input: &[u8]) -> pb::StepCall {
        pb::StepCall {
            saga_id: self.saga,
            step: STEP,
            operation_id: op.to_string(),
            action: action.to_string(),
            input: input.to_vec(),
            fingerprint: format!("kit-{}", self.saga),
            precondition: String::new(),
            forward_operation_id: String::new(),
            authorization: Some(pb::SagaAuthorization {
                principal: "dtx-conformance".into(),
                tenant: String::new(),
                expires_at_ms: 0,
                policy: String::new(),
            }),
            term: 1,
            outputs: Vec::new(),
        }
    }

    fn forward_call(&self, op: &str, input: &[u8]) -> pb::StepCall {
        self.call(op, &self.p.forward_action, input)
    }

    fn compensate_call(&self, op: &str, forward_op: &str, precondition: &str) -> pb::StepCall {
        let action = self.p.compensate_action.clone().unwrap_or_default();
        let mut c = self.call(op, &action, &self.ok_input());
        c.forward_operation_id = forward_op.to_string();
        c.precondition = precondition.to_string();
        c
    }

    async fn forward(&mut self, call: pb::StepCall) -> Reply<pb::StepReply> {
        send_forward(self.client.clone(), &mut self.rec, call).await
    }

    async fn compensate(&mut self, call: pb::StepCall) -> Reply<pb::StepReply> {
        let sent = format!(
            "Compensate(op {:?}, action {:?}, forward op {:?}, precondition {:?})",
            call.operation_id, call.action, call.forward_operation_id, call.precondition
        );
        let rq = self.rec.request(call);
        let mut c = self.client.clone();
        self.rec.call(sent, c.compensate(rq), show_reply).await
    }

    async fn status(&mut self, op: &str, fence: bool) -> Reply<pb::StepStatusReply> {
        let msg = pb::StepStatusRequest {
            operation_id: op.to_string(),
            query: self.p.status_query.clone(),
        };
        let sent = format!(
            "{}(op {op:?}, query {:?})",
            if fence { "Fence" } else { "Status" },
            self.p.status_query
        );
        let rq = self.rec.request(msg);
        let mut c = self.client.clone();
        if fence {
            self.rec.call(sent, c.fence(rq), show_status).await
        } else {
            self.rec.call(sent, c.status(rq), show_status).await
        }
    }

    /// The reply, which must be `want`.
    fn outcome(r: Reply<pb::StepReply>, want: Out, what: &str) -> Step<pb::StepReply> {
        let a = answer(r, what)?;
        if a.outcome != want as i32 {
            return broken(format!(
                "{what} answered {}; the rule asks {}",
                show_reply(&a),
                want.as_str_name().trim_start_matches("STEP_OUTCOME_")
            ));
        }
        Ok(a)
    }

    async fn forward_is(&mut self, op: &str, input: &[u8], want: Out) -> Step<pb::StepReply> {
        let call = self.forward_call(op, input);
        let r = self.forward(call).await;
        Self::outcome(r, want, &format!("Forward {op:?}"))
    }

    /// A repeat answered the same as `first`.
    fn repeated(first: &pb::StepReply, again: Reply<pb::StepReply>, what: &str) -> Step<()> {
        let again = answer(again, what)?;
        if !same_reply(first, &again) {
            return broken(format!(
                "{what} answered {}; the first call answered {} (a repeat must answer the stored reply)",
                show_reply(&again),
                show_reply(first)
            ));
        }
        Ok(())
    }

    /// Status (or Fence) answers `want`: not applied (`None`) or applied
    /// with a reply like `want`.
    async fn status_is(&mut self, op: &str, fence: bool, want: Option<&pb::StepReply>) -> Step<()> {
        let r = self.status(op, fence).await;
        let what = format!("{} of {op:?}", if fence { "Fence" } else { "Status" });
        let a = answer(r, &what)?;
        match (want, a.applied, a.reply.as_ref()) {
            (None, false, _) => Ok(()),
            (Some(w), true, Some(got)) if same_reply(w, got) => Ok(()),
            (None, _, _) => broken(format!(
                "{what} answered {}; the rule asks not applied",
                show_status(&a)
            )),
            (Some(w), _, _) => broken(format!(
                "{what} answered {}; the rule asks applied: {}",
                show_status(&a),
                show_reply(w)
            )),
        }
    }

    /// Status (or Fence) answers applied with outcome `want`.
    async fn status_outcome(&mut self, op: &str, fence: bool, want: Out) -> Step<()> {
        let r = self.status(op, fence).await;
        let what = format!("{} of {op:?}", if fence { "Fence" } else { "Status" });
        let a = answer(r, &what)?;
        match (a.applied, a.reply.as_ref()) {
            (true, Some(got)) if got.outcome == want as i32 => Ok(()),
            _ => broken(format!(
                "{what} answered {}; the rule asks applied: {}",
                show_status(&a),
                want.as_str_name().trim_start_matches("STEP_OUTCOME_")
            )),
        }
    }
}

/// A forward call through `client`, noted in `rec`.
async fn send_forward(
    mut client: SagaStepServiceClient<Channel>,
    rec: &mut Recorder,
    call: pb::StepCall,
) -> Reply<pb::StepReply> {
    let sent = format!(
        "Forward(op {:?}, action {:?}, input {}, fingerprint {:?})",
        call.operation_id,
        call.action,
        show_payload(&call.input),
        call.fingerprint
    );
    let rq = rec.request(call);
    rec.call(sent, client.forward(rq), show_reply).await
}

/// Runs `rule` against the step service at `target`.
pub async fn run_step_rule(
    rule: &StepRule,
    target: &Target,
    profile: &StepProfile,
    service: Option<Arc<dyn Service>>,
) -> RuleReport {
    // A saga id of its own, within what JSON numbers hold exactly.
    let saga = (rand::random::<u64>() >> 12).max(1);
    let mut report = RuleReport {
        id: rule.id,
        title: rule.title,
        section: SECTION,
        verdict: Verdict::Unknown,
        detail: String::new(),
        transcript: Vec::new(),
        scope: format!("saga {saga}"),
    };
    let channel = match crate::wire::connect(target) {
        Ok(c) => c,
        Err(e) => {
            report.detail = format!("cannot reach {}: {e}", target.address);
            return report;
        }
    };
    let mut cx = StepCx {
        client: SagaStepServiceClient::new(channel),
        rec: Recorder::new(target),
        p: profile,
        target,
        service,
        saga,
        next: 0,
    };
    let result = dispatch(rule.id, &mut cx).await;
    report.transcript = std::mem::take(&mut cx.rec.transcript);
    (report.verdict, report.detail) = crate::ctx::verdict(result);
    report
}

async fn dispatch(id: &str, cx: &mut StepCx<'_>) -> Step<Done> {
    let failed = cx.p.failed_input.clone();
    let needs_failed =
        || Done::Skipped("the profile gives no input the forward action answers FAILED on (--failed-input)".into());
    let compensates = [
        "step.kind",
        "step.compensate-",
        "step.stale",
        "step.crash.after-compensate",
    ];
    if cx.p.compensate_action.is_none() && compensates.iter().any(|c| id.starts_with(c)) {
        return Ok(Done::Skipped(
            "the profile names no compensation (--compensate-action): the step has none".into(),
        ));
    }
    match id {
        "step.forward-repeat" => forward_repeat(cx).await,
        "step.failed-repeat" => match failed {
            Some(f) => failed_repeat(cx, &f).await,
            None => Ok(needs_failed()),
        },
        "step.status-unseen" => status_unseen(cx).await,
        "step.status-applied" => status_applied(cx).await,
        "step.fence-unseen" => fence_unseen(cx).await,
        "step.fence-applied" => fence_applied(cx).await,
        "step.fingerprint" => fingerprint(cx).await,
        "step.kind" => kind(cx).await,
        "step.no-operation-id" => no_operation_id(cx).await,
        "step.compensate-noop" => compensate_noop(cx).await,
        "step.compensate-after-failed" => match failed {
            Some(f) => compensate_after_failed(cx, &f).await,
            None => Ok(needs_failed()),
        },
        "step.compensate-repeat" => compensate_repeat(cx).await,
        "step.stale" if cx.p.versioned => stale(cx).await,
        "step.stale" => Ok(Done::Skipped(
            "the profile does not say the step is versioned (--versioned)".into(),
        )),
        _ if cx.service.is_none() => Ok(Done::Skipped(
            "the kit did not start the service (--start): it cannot crash it".into(),
        )),
        "step.crash.after-forward" => crash_after_forward(cx).await,
        "step.crash.in-forward" => crash_in_forward(cx).await,
        "step.crash.after-fence" => crash_after_fence(cx).await,
        "step.crash.after-compensate" => crash_after_compensate(cx).await,
        _ => unreachable!("a step rule without a body: {id}"),
    }
}

async fn forward_repeat(cx: &mut StepCx<'_>) -> Step<Done> {
    let (f, input, first) = cx.forward_ok().await?;
    for _ in 0..2 {
        let call = cx.forward_call(&f, &input);
        let again = cx.forward(call).await;
        StepCx::repeated(&first, again, &format!("the repeated Forward {f:?}"))?;
    }
    Ok(Done::Passed)
}

async fn failed_repeat(cx: &mut StepCx<'_>, failed: &str) -> Step<Done> {
    let f = cx.op('f');
    let input = cx.input(failed);
    let first = cx.forward_is(&f, &input, Out::Failed).await?;
    // Even with the OK input now: the stored FAILED answers.
    let ok_input = cx.ok_input();
    let call = cx.forward_call(&f, &ok_input);
    let again = cx.forward(call).await;
    StepCx::repeated(&first, again, &format!("the repeated Forward {f:?}"))?;
    Ok(Done::Passed)
}

async fn status_unseen(cx: &mut StepCx<'_>) -> Step<Done> {
    let f = cx.op('f');
    cx.status_is(&f, false, None).await?;
    cx.status_is(&f, false, None).await?;
    let input = cx.ok_input();
    cx.forward_is(&f, &input, Out::Ok).await?;
    Ok(Done::Passed)
}

async fn status_applied(cx: &mut StepCx<'_>) -> Step<Done> {
    let (f, _, first) = cx.forward_ok().await?;
    cx.status_is(&f, false, Some(&first)).await?;
    Ok(Done::Passed)
}

async fn fence_unseen(cx: &mut StepCx<'_>) -> Step<Done> {
    let f = cx.op('f');
    // Not applied, and from now on never: recorded FAILED ("fenced").
    cx.status_is(&f, true, None).await?;
    let input = cx.ok_input();
    cx.forward_is(&f, &input, Out::Failed).await?;
    cx.status_outcome(&f, false, Out::Failed).await?;
    cx.status_outcome(&f, true, Out::Failed).await?;
    Ok(Done::Passed)
}

async fn fence_applied(cx: &mut StepCx<'_>) -> Step<Done> {
    let (f, _, first) = cx.forward_ok().await?;
    cx.status_is(&f, true, Some(&first)).await?;
    cx.status_is(&f, false, Some(&first)).await?;
    Ok(Done::Passed)
}

async fn fingerprint(cx: &mut StepCx<'_>) -> Step<Done> {
    let (f, input, first) = cx.forward_ok().await?;
    let mut other = cx.forward_call(&f, &input);
    other.fingerprint = format!("kit-other-{}", cx.saga);
    let r = cx.forward(other).await;
    refused(
        r,
        Code::FailedPrecondition,
        "",
        &format!("Forward {f:?} with another fingerprint"),
    )?;
    cx.status_is(&f, false, Some(&first)).await?;
    Ok(Done::Passed)
}

async fn kind(cx: &mut StepCx<'_>) -> Step<Done> {
    let (f, _, first) = cx.forward_ok().await?;
    let call = cx.compensate_call(&f, &f, &first.resource_version);
    let r = cx.compensate(call).await;
    refused(
        r,
        Code::FailedPrecondition,
        "",
        &format!("Compensate under the forward's operation id {f:?}"),
    )?;
    cx.status_is(&f, false, Some(&first)).await?;
    Ok(Done::Passed)
}

async fn no_operation_id(cx: &mut StepCx<'_>) -> Step<Done> {
    let input = cx.ok_input();
    let call = cx.forward_call("", &input);
    let r = cx.forward(call).await;
    refused(r, Code::InvalidArgument, "", "Forward without an operation id")?;
    Ok(Done::Passed)
}

async fn compensate_noop(cx: &mut StepCx<'_>) -> Step<Done> {
    let f = cx.op('f');
    let c = cx.op('c');
    let call = cx.compensate_call(&c, &f, "");
    let r = cx.compensate(call).await;
    StepCx::outcome(r, Out::Noop, &format!("Compensate {c:?} of the never-run {f:?}"))?;
    // The forward operation is fenced: a late call of it never runs.
    let input = cx.ok_input();
    cx.forward_is(&f, &input, Out::Failed).await?;
    cx.status_outcome(&f, false, Out::Failed).await?;
    Ok(Done::Passed)
}

async fn compensate_after_failed(cx: &mut StepCx<'_>, failed: &str) -> Step<Done> {
    let f = cx.op('f');
    let input = cx.input(failed);
    cx.forward_is(&f, &input, Out::Failed).await?;
    let c = cx.op('c');
    let call = cx.compensate_call(&c, &f, "");
    let r = cx.compensate(call).await;
    StepCx::outcome(r, Out::Noop, &format!("Compensate {c:?} of the FAILED {f:?}"))?;
    Ok(Done::Passed)
}

async fn compensate_repeat(cx: &mut StepCx<'_>) -> Step<Done> {
    let (f, _, done) = cx.forward_ok().await?;
    let c = cx.op('c');
    let call = cx.compensate_call(&c, &f, &done.resource_version);
    let r = cx.compensate(call.clone()).await;
    let first = StepCx::outcome(r, Out::Ok, &format!("Compensate {c:?}"))?;
    let again = cx.compensate(call).await;
    StepCx::repeated(&first, again, &format!("the repeated Compensate {c:?}"))?;
    cx.status_is(&c, false, Some(&first)).await?;
    Ok(Done::Passed)
}

async fn stale(cx: &mut StepCx<'_>) -> Step<Done> {
    let (f, _, done) = cx.forward_ok().await?;
    let c = cx.op('c');
    let wrong = format!("{}-not-this-version", done.resource_version);
    let call = cx.compensate_call(&c, &f, &wrong);
    let r = cx.compensate(call).await;
    StepCx::outcome(r, Out::Stale, &format!("Compensate {c:?} with precondition {wrong:?}"))?;
    // Nothing changed: the compensation at the right version still undoes it.
    let c2 = cx.op('c');
    let call = cx.compensate_call(&c2, &f, &done.resource_version);
    let r = cx.compensate(call).await;
    StepCx::outcome(r, Out::Ok, &format!("Compensate {c2:?} at the forward's version"))?;
    Ok(Done::Passed)
}

async fn crash_after_forward(cx: &mut StepCx<'_>) -> Step<Done> {
    let (f, input, first) = cx.forward_ok().await?;
    cx.crash("after the forward reply").await?;
    cx.status_is(&f, false, Some(&first)).await?;
    let call = cx.forward_call(&f, &input);
    let again = cx.forward(call).await;
    StepCx::repeated(&first, again, &format!("the Forward {f:?} repeated after the restart"))?;
    Ok(Done::Passed)
}

async fn crash_in_forward(cx: &mut StepCx<'_>) -> Step<Done> {
    let f = cx.op('f');
    let input = cx.ok_input();
    let call = cx.forward_call(&f, &input);
    let reply = cx.forward_killed(call).await?;
    let answered = match reply {
        Reply::Answer(a) => Some(a),
        _ => None,
    };
    let r = cx.status(&f, false).await;
    let status = answer(r, &format!("Status of {f:?} after the restart"))?;
    match (&answered, status.applied, status.reply.as_ref()) {
        (Some(a), true, Some(got)) if same_reply(a, got) => {}
        (None, false, _) => {}
        (None, true, Some(got)) if got.outcome == Out::Ok as i32 => {}
        _ => {
            return broken(format!(
                "after the restart Status of {f:?} answers {}; {}",
                show_status(&status),
                match &answered {
                    Some(a) => format!("the call had answered {}, so that reply must be stored", show_reply(a)),
                    None => "a call cut short is done (OK) or not at all".into(),
                }
            ))
        }
    }
    let call = cx.forward_call(&f, &input);
    let r = cx.forward(call).await;
    let done = StepCx::outcome(r, Out::Ok, &format!("the Forward {f:?} repeated after the restart"))?;
    if let (true, Some(got)) = (status.applied, status.reply.as_ref()) {
        if !same_reply(got, &done) {
            return broken(format!(
                "the repeated Forward {f:?} answered {}; Status had answered the stored {}",
                show_reply(&done),
                show_reply(got)
            ));
        }
    }
    cx.status_is(&f, false, Some(&done)).await?;
    Ok(Done::Passed)
}

async fn crash_after_fence(cx: &mut StepCx<'_>) -> Step<Done> {
    let f = cx.op('f');
    cx.status_is(&f, true, None).await?;
    cx.crash("after the fence").await?;
    let input = cx.ok_input();
    cx.forward_is(&f, &input, Out::Failed).await?;
    Ok(Done::Passed)
}

async fn crash_after_compensate(cx: &mut StepCx<'_>) -> Step<Done> {
    let (f, _, done) = cx.forward_ok().await?;
    let c = cx.op('c');
    let call = cx.compensate_call(&c, &f, &done.resource_version);
    let r = cx.compensate(call.clone()).await;
    let first = StepCx::outcome(r, Out::Ok, &format!("Compensate {c:?}"))?;
    cx.crash("after the compensation's reply").await?;
    let again = cx.compensate(call).await;
    StepCx::repeated(
        &first,
        again,
        &format!("the Compensate {c:?} repeated after the restart"),
    )?;
    cx.status_is(&f, false, Some(&done)).await?;
    Ok(Done::Passed)
}

/// Runs every step rule (or those whose id starts with one of `only`);
/// with `service` (the kit started it) the crash rules too.
pub async fn run_steps(
    target: &Target,
    profile: &StepProfile,
    only: &[String],
    service: Option<Arc<dyn Service>>,
) -> crate::report::Report {
    let mut rules = Vec::new();
    for rule in STEP_RULES {
        if !only.is_empty() && !only.iter().any(|o| rule.id.starts_with(o.as_str())) {
            continue;
        }
        rules.push(run_step_rule(rule, target, profile, service.clone()).await);
    }
    crate::report::Report {
        address: target.address.clone(),
        participant_id: target.participant_id.clone(),
        rules,
    }
}
