//! Whether this node serves: one notion, computed in one place, and
//! everything that shows it reads it from here: `grpc.health.v1` on both
//! gRPC ports, `ClusterStatus.serving` and its reason, the metrics port's
//! `/health`, and the gauges `dtx_serving` and `dtx_raft_is_leader`.
//!
//! The rule ([`judge`]), with `limit` = `raft.election_timeout_max_ms`
//! ("about an election timeout"):
//! 1. Raft runs (it did not stop on a fatal error, and its core answers
//!    within `limit`).
//! 2. A leader is known (openraft's `current_leader`: a committed vote).
//! 3. If this node is that leader: a majority of the voters acknowledged
//!    it within `limit` (openraft's `RaftMetrics::millis_since_quorum_ack`,
//!    the age of the newest AppendEntries round a quorum answered; a
//!    request the transport answered itself counts, so up to
//!    `raft.commit_index_defer_max_ms` younger than the last real answer:
//!    `raft::deferred_commit`).
//!    openraft 0.9 has no check-quorum: a leader cut off from its majority
//!    stays `Leader` in its old term while the others elect a new one; this
//!    is what tells it apart.
//! 4. If another node leads: this node had a message from it within
//!    `limit` (openraft touches the vote on every AppendEntries, heartbeats
//!    included: `RaftState::vote_last_modified`).
//! 5. Every node: it applies what it knows to be committed
//!    (`RaftState::committed`): its applied index has not stayed behind a
//!    committed index it knew for longer than `limit` ([`ApplyLag`]; a
//!    lag of a few entries under load, caught up within the limit, is
//!    normal and does not count).
//!
//! A task ([`spawn`]) evaluates the rule every heartbeat interval and
//! publishes the result ([`Monitor`]); the health services are set from it
//! when it changes. The per-member reach shown by `ClusterStatus` comes
//! from here too ([`member_reach`]): on the leader, from the quorum probe's
//! answers (openraft 0.9.25 keeps no per-member timing it exposes: the
//! replication metrics carry only the matched log id); on a follower, for
//! the leader only, from the last Raft message.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::task::Context;
use std::task::Poll;
use std::time::Duration;

use dtx_proto::v1::MemberReach;
use tokio::time::Instant;
use tonic::codegen::http;
use tonic::codegen::Service;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;
use tracing::info;
use tracing::warn;

use super::NodeId;
use super::Raft;

/// The thresholds of the rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Longest silence, in ms, of the majority (for a leader) or of the
    /// leader (for the others) that still counts as serving.
    pub silence_ms: u64,
    /// Longest time, in ms, the applied index may stay behind a committed
    /// index this node knew.
    pub apply_behind_ms: u64,
}

impl Limits {
    /// The limits of a node with this configuration: both about one
    /// election timeout (`raft.election_timeout_max_ms`).
    pub fn of(config: &crate::config::Config) -> Limits {
        Limits {
            silence_ms: config.raft.election_timeout_max_ms,
            apply_behind_ms: config.raft.election_timeout_max_ms,
        }
    }
}

/// What the rule looks at, read from openraft at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inputs {
    pub me: NodeId,
    /// Why Raft cannot serve at all (it stopped on a fatal error, or its
    /// core does not answer), if so: the reason as shown.
    pub stopped: Option<String>,
    /// The node holds cluster state (a membership with at least one voter).
    pub initialized: bool,
    /// openraft's `current_leader`.
    pub leader: Option<NodeId>,
    /// For a leader: openraft's `millis_since_quorum_ack`.
    pub millis_since_quorum_ack: Option<u64>,
    /// For a node led by another: ms since its last message from the
    /// leader (None: none since this process started).
    pub leader_heard_ms_ago: Option<u64>,
    pub applied: u64,
    /// The committed index this node knows.
    pub committed: u64,
    /// How long, in ms, the applied index has been behind a committed
    /// index this node knew ([`ApplyLag`]); 0 when caught up.
    pub apply_behind_ms: u64,
}

/// The answer of the rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub serving: bool,
    /// Why not; empty when serving.
    pub reason: String,
}

impl Verdict {
    fn serving() -> Verdict {
        Verdict {
            serving: true,
            reason: String::new(),
        }
    }

    fn not(reason: String) -> Verdict {
        Verdict { serving: false, reason }
    }
}

/// The serving rule (see the module documentation). Pure.
pub fn judge(i: &Inputs, l: &Limits) -> Verdict {
    if let Some(why) = &i.stopped {
        return Verdict::not(why.clone());
    }
    let Some(leader) = i.leader else {
        return Verdict::not(if i.initialized {
            "no leader known (an election is under way, or this node reaches no majority)".to_string()
        } else {
            "no leader known: this node holds no cluster state yet (not bootstrapped, or not added to a cluster)"
                .to_string()
        });
    };
    if leader == i.me {
        match i.millis_since_quorum_ack {
            None => return Verdict::not("leader has not heard from a majority yet".to_string()),
            Some(ms) if ms > l.silence_ms => {
                return Verdict::not(format!("leader has not heard from a majority for {ms} ms"))
            }
            Some(_) => {}
        }
    } else {
        match i.leader_heard_ms_ago {
            None => return Verdict::not(format!("no message from leader {leader} since this node started")),
            Some(ms) if ms > l.silence_ms => {
                return Verdict::not(format!("no message from leader {leader} for {ms} ms"))
            }
            Some(_) => {}
        }
    }
    if i.apply_behind_ms > l.apply_behind_ms {
        return Verdict::not(format!(
            "applied index {} behind committed index {} for {} ms",
            i.applied, i.committed, i.apply_behind_ms
        ));
    }
    Verdict::serving()
}

/// How long the applied index has been behind a committed index this
/// node knew. It remembers one target (the committed index when it first
/// saw the node behind) and its time; passing the target starts a new
/// window, so a node that keeps up under load (always a few entries
/// behind, never for long) never accumulates.
#[derive(Clone, Debug, Default)]
pub struct ApplyLag {
    target: Option<(u64, Instant)>,
}

impl ApplyLag {
    /// Observes (applied, committed) at `now`; returns the time behind.
    pub fn observe(&mut self, applied: u64, committed: u64, now: Instant) -> Duration {
        if applied >= committed {
            self.target = None;
            return Duration::ZERO;
        }
        match self.target {
            Some((target, since)) if applied < target => now.saturating_duration_since(since),
            _ => {
                self.target = Some((committed, now));
                Duration::ZERO
            }
        }
    }
}

/// When this node last heard from each other voter, written by the quorum
/// probe (`raft::quorum_probe`) at each answer.
#[derive(Clone, Debug, Default)]
pub struct PeerContacts(Arc<Mutex<BTreeMap<NodeId, Instant>>>);

impl PeerContacts {
    pub fn heard(&self, id: NodeId, at: Instant) {
        let mut m = self.0.lock().expect("peer contacts lock");
        let e = m.entry(id).or_insert(at);
        *e = (*e).max(at);
    }

    pub fn last(&self, id: NodeId) -> Option<Instant> {
        self.0.lock().expect("peer contacts lock").get(&id).copied()
    }
}

/// One member's reach as the answering node sees it, and ms since it
/// heard from the member (0 when not known). Pure.
///
/// - The answering node itself: SELF.
/// - On the leader, every other member, by the quorum probe's last answer
///   (`heard_ms_ago`): REACHABLE within `silence_ms`, UNREACHABLE after it
///   or when it never answered; UNSPECIFIED when the probe is off
///   (`raft.quorum_probe_interval_ms = 0`: nothing is measured). A learner
///   is not probed (the probe asks voters): UNSPECIFIED.
/// - On any other node, the leader only, by its last Raft message.
///   Others: UNSPECIFIED.
pub fn member_reach(
    me: NodeId,
    member: NodeId,
    leader: Option<NodeId>,
    measured: bool,
    heard_ms_ago: Option<u64>,
    silence_ms: u64,
) -> (MemberReach, u64) {
    if member == me {
        return (MemberReach::Self_, 0);
    }
    let leading = leader == Some(me);
    if !(leading && measured) && leader != Some(member) {
        return (MemberReach::Unspecified, 0);
    }
    match heard_ms_ago {
        Some(ms) if ms <= silence_ms => (MemberReach::Reachable, ms),
        Some(ms) => (MemberReach::Unreachable, ms),
        None => (MemberReach::Unreachable, 0),
    }
}

/// The latest evaluation.
#[derive(Clone, Debug)]
pub struct Status {
    pub verdict: Verdict,
    pub inputs: Inputs,
    /// When this node last had a Raft message from the leader it follows.
    pub leader_heard: Option<Instant>,
}

/// A handle on a node's serving state (cheap to clone): what the API and
/// the node's reporters read.
#[derive(Clone)]
pub struct Monitor {
    rx: tokio::sync::watch::Receiver<Status>,
    contacts: PeerContacts,
    /// The quorum probe runs (per-member timing is measured).
    probing: bool,
    limits: Limits,
}

impl Monitor {
    /// The latest evaluation (at most one heartbeat interval old).
    pub fn status(&self) -> Status {
        self.rx.borrow().clone()
    }

    /// [`member_reach`] of `member` (a voter or not) now, for a node whose
    /// Raft metrics say `me` and `leader`.
    pub fn member_reach(&self, me: NodeId, member: NodeId, voter: bool, leader: Option<NodeId>) -> (MemberReach, u64) {
        let now = Instant::now();
        let heard = if leader == Some(me) {
            self.contacts.last(member)
        } else if leader == Some(member) {
            self.rx.borrow().leader_heard
        } else {
            None
        };
        let ms = heard.map(|t| now.saturating_duration_since(t).as_millis() as u64);
        // The probe asks voters only: a learner is not measured.
        member_reach(me, member, leader, self.probing && voter, ms, self.limits.silence_ms)
    }

    /// A layer putting this handle into every request's extensions, where
    /// the API's handlers find it (`ClusterStatus`).
    pub fn layer(&self) -> MonitorLayer {
        MonitorLayer(self.clone())
    }
}

/// The health services one port answers for, set from the serving state.
pub struct HealthTarget {
    pub reporter: HealthReporter,
    /// Service names, "" (the whole server) included.
    pub services: Vec<&'static str>,
}

impl HealthTarget {
    /// Sets every service of the port to `serving`.
    pub async fn set(&self, serving: bool) {
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for s in &self.services {
            self.reporter.set_service_status(*s, status).await;
        }
    }
}

fn starting() -> Status {
    Status {
        verdict: Verdict::not("the node is starting".to_string()),
        inputs: Inputs::default(),
        leader_heard: None,
    }
}

/// Starts the task that evaluates the rule for `raft` every `tick` and
/// sets `health` on every change, until `stop` turns true (then every
/// service is set NOT_SERVING). `probing`: the quorum probe runs and
/// writes `contacts`.
pub fn spawn(
    raft: Raft,
    limits: Limits,
    tick: Duration,
    contacts: PeerContacts,
    probing: bool,
    health: Vec<HealthTarget>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> (Monitor, tokio::task::JoinHandle<()>) {
    // openraft stamps the vote it loads at start with the time it loaded
    // it: that is no message from a leader.
    let started = Instant::now();
    let (tx, rx) = tokio::sync::watch::channel(starting());
    let monitor = Monitor {
        rx,
        contacts,
        probing,
        limits,
    };
    let task = tokio::spawn(async move {
        let mut lag = ApplyLag::default();
        let mut shown: Option<bool> = None;
        let mut interval = tokio::time::interval(tick);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = interval.tick() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            let status = evaluate(&raft, &limits, &mut lag, started).await;
            let serving = status.verdict.serving;
            if shown != Some(serving) {
                if serving {
                    info!("serving: SERVING on both ports' health services");
                } else if shown.is_some() {
                    warn!(reason = %status.verdict.reason, "not serving: NOT_SERVING on both ports' health services");
                } else {
                    info!(reason = %status.verdict.reason, "not serving yet");
                }
                for h in &health {
                    h.set(serving).await;
                }
                shown = Some(serving);
            }
            tx.send_replace(status);
        }
        let mut s = starting();
        s.verdict = Verdict::not("the node is stopping".to_string());
        tx.send_replace(s);
        for h in &health {
            h.set(false).await;
        }
    });
    (monitor, task)
}

/// Reads the inputs from `raft` and judges them. A vote last touched
/// before `started` was touched by loading it, not by a leader.
async fn evaluate(raft: &Raft, limits: &Limits, lag: &mut ApplyLag, started: Instant) -> Status {
    let mut i = {
        let rx = raft.metrics();
        let m = rx.borrow();
        Inputs {
            me: m.id,
            stopped: m.running_state.as_ref().err().map(|e| format!("raft stopped: {e}")),
            initialized: m.membership_config.membership().voter_ids().next().is_some(),
            leader: m.current_leader,
            millis_since_quorum_ack: m.millis_since_quorum_ack,
            leader_heard_ms_ago: None,
            applied: m.last_applied.map(|l| l.index).unwrap_or(0),
            committed: 0,
            apply_behind_ms: 0,
        }
    };
    let mut leader_heard = None;
    if i.stopped.is_none() {
        // What openraft keeps in its core only: the committed index this
        // node knows, and when the vote was last touched (every message of
        // the leader touches it).
        let wait = Duration::from_millis(limits.silence_ms.max(100));
        let read = raft.with_raft_state(|st| (st.committed.map(|c| c.index), st.vote_last_modified()));
        match tokio::time::timeout(wait, read).await {
            Ok(Ok((committed, touched))) => {
                let now = Instant::now();
                i.committed = committed.unwrap_or(0);
                i.apply_behind_ms = lag.observe(i.applied, i.committed, now).as_millis() as u64;
                if i.leader.is_some_and(|l| l != i.me) {
                    leader_heard = touched.filter(|t| *t > started);
                    i.leader_heard_ms_ago = leader_heard.map(|t| now.saturating_duration_since(t).as_millis() as u64);
                }
            }
            Ok(Err(e)) => i.stopped = Some(format!("raft stopped: {e}")),
            Err(_) => {
                i.stopped = Some(format!(
                    "raft's core did not answer within {} ms (busy or stuck)",
                    wait.as_millis()
                ))
            }
        }
    }
    Status {
        verdict: judge(&i, limits),
        inputs: i,
        leader_heard,
    }
}

/// See [`Monitor::layer`].
#[derive(Clone)]
pub struct MonitorLayer(Monitor);

impl<S> tower_layer::Layer<S> for MonitorLayer {
    type Service = WithMonitor<S>;

    fn layer(&self, inner: S) -> WithMonitor<S> {
        WithMonitor {
            inner,
            monitor: self.0.clone(),
        }
    }
}

#[derive(Clone)]
pub struct WithMonitor<S> {
    inner: S,
    monitor: Monitor,
}

impl<S, B> Service<http::Request<B>> for WithMonitor<S>
where
    S: Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        req.extensions_mut().insert(self.monitor.clone());
        self.inner.call(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits {
        silence_ms: 500,
        apply_behind_ms: 500,
    };

    fn follower() -> Inputs {
        Inputs {
            me: 2,
            initialized: true,
            leader: Some(1),
            leader_heard_ms_ago: Some(80),
            applied: 10,
            committed: 10,
            ..Default::default()
        }
    }

    fn leader() -> Inputs {
        Inputs {
            me: 1,
            initialized: true,
            leader: Some(1),
            millis_since_quorum_ack: Some(90),
            applied: 10,
            committed: 10,
            ..Default::default()
        }
    }

    fn reason(i: &Inputs) -> String {
        let v = judge(i, &L);
        assert!(!v.serving, "{i:?} serves");
        v.reason
    }

    #[test]
    fn a_leader_serves_only_while_a_majority_acknowledges_it() {
        assert_eq!(judge(&leader(), &L), Verdict::serving());
        let at_limit = Inputs {
            millis_since_quorum_ack: Some(500),
            ..leader()
        };
        assert!(judge(&at_limit, &L).serving);
        let cut_off = Inputs {
            millis_since_quorum_ack: Some(1850),
            ..leader()
        };
        assert_eq!(reason(&cut_off), "leader has not heard from a majority for 1850 ms");
        let new = Inputs {
            millis_since_quorum_ack: None,
            ..leader()
        };
        assert_eq!(reason(&new), "leader has not heard from a majority yet");
    }

    #[test]
    fn a_follower_serves_only_while_it_hears_from_the_leader() {
        assert!(judge(&follower(), &L).serving);
        let silent = Inputs {
            leader_heard_ms_ago: Some(501),
            ..follower()
        };
        assert_eq!(reason(&silent), "no message from leader 1 for 501 ms");
        let restarted = Inputs {
            leader_heard_ms_ago: None,
            ..follower()
        };
        assert_eq!(reason(&restarted), "no message from leader 1 since this node started");
        // The leader's quorum timing means nothing on a follower.
        let odd = Inputs {
            millis_since_quorum_ack: Some(10_000),
            ..follower()
        };
        assert!(judge(&odd, &L).serving);
    }

    #[test]
    fn no_leader_or_no_raft_is_not_serving() {
        let none = Inputs {
            leader: None,
            ..follower()
        };
        assert!(reason(&none).starts_with("no leader known ("));
        let fresh = Inputs {
            me: 1,
            ..Default::default()
        };
        assert!(reason(&fresh).starts_with("no leader known: this node holds no cluster state"));
        let stopped = Inputs {
            stopped: Some("raft stopped: storage error".into()),
            ..leader()
        };
        assert_eq!(reason(&stopped), "raft stopped: storage error");
    }

    #[test]
    fn applying_behind_counts_only_past_the_limit() {
        let briefly = Inputs {
            applied: 8,
            apply_behind_ms: 400,
            ..follower()
        };
        assert!(judge(&briefly, &L).serving);
        let stuck = Inputs {
            applied: 8,
            apply_behind_ms: 2000,
            ..follower()
        };
        assert_eq!(reason(&stuck), "applied index 8 behind committed index 10 for 2000 ms");
        let stuck_leader = Inputs {
            applied: 8,
            apply_behind_ms: 2000,
            ..leader()
        };
        assert!(!judge(&stuck_leader, &L).serving);
    }

    #[test]
    fn apply_lag_measures_a_stall_not_a_steady_small_lag() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut lag = ApplyLag::default();
        assert_eq!(lag.observe(10, 10, at(0)), Duration::ZERO);
        // Under load: always a few behind, but past the last target each time.
        assert_eq!(lag.observe(10, 13, at(100)), Duration::ZERO);
        assert_eq!(lag.observe(13, 16, at(200)), Duration::ZERO);
        assert_eq!(lag.observe(16, 19, at(300)), Duration::ZERO);
        // Stalled: the target 19 (set at 300 ms) is not reached.
        assert_eq!(lag.observe(18, 25, at(400)), Duration::from_millis(100));
        assert_eq!(lag.observe(18, 25, at(1300)), Duration::from_millis(1000));
        // Caught up.
        assert_eq!(lag.observe(25, 25, at(1400)), Duration::ZERO);
    }

    #[test]
    fn reach_is_known_on_the_leader_and_for_the_leader() {
        // The answering node.
        assert_eq!(member_reach(1, 1, Some(1), true, None, 500), (MemberReach::Self_, 0));
        assert_eq!(member_reach(2, 2, None, false, None, 500), (MemberReach::Self_, 0));
        // The leader's view of the others, by the probe.
        assert_eq!(
            member_reach(1, 2, Some(1), true, Some(120), 500),
            (MemberReach::Reachable, 120)
        );
        assert_eq!(
            member_reach(1, 3, Some(1), true, Some(4000), 500),
            (MemberReach::Unreachable, 4000)
        );
        assert_eq!(
            member_reach(1, 3, Some(1), true, None, 500),
            (MemberReach::Unreachable, 0)
        );
        assert_eq!(
            member_reach(1, 3, Some(1), false, None, 500),
            (MemberReach::Unspecified, 0)
        );
        // A follower: the leader only.
        assert_eq!(
            member_reach(2, 1, Some(1), true, Some(90), 500),
            (MemberReach::Reachable, 90)
        );
        assert_eq!(
            member_reach(2, 1, Some(1), false, Some(900), 500),
            (MemberReach::Unreachable, 900)
        );
        assert_eq!(
            member_reach(2, 3, Some(1), true, Some(90), 500),
            (MemberReach::Unspecified, 0)
        );
        assert_eq!(member_reach(2, 3, None, true, None, 500), (MemberReach::Unspecified, 0));
    }
}
