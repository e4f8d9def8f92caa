//! The quorum probe: a node that cannot reach a quorum of voters does not
//! campaign (docs/adr/0008-disruptive-rejoins.md).
//!
//! openraft 0.9 has no pre-vote. A follower cut off from the leader times
//! out and campaigns again and again, each time in a new term, and when it
//! comes back its higher term reaches the leader in the answer to the
//! leader's next AppendEntries: the leader adopts the term and steps down,
//! and the cluster cannot write until a new leader is elected. openraft's
//! leader lease only makes voters ignore such a candidate's RequestVote; it
//! does not stop the candidate's term from climbing.
//!
//! So every `raft.quorum_probe_interval_ms` this node asks each other voter
//! over the Raft transport (`RaftTransport.Probe`, answered at once without
//! touching Raft state) whether it is there. While the voters that answer
//! (this node included) are not a majority of every voter set of the current
//! membership (both during a joint change), elections are switched off with
//! openraft's runtime switch `Raft::runtime_config().elect(false)`, so the
//! term stays where it is. Once a quorum has answered without a break for
//! `raft.election_timeout_max_ms` they are switched on again: that wait lets
//! a live leader (heartbeat every `raft.heartbeat_interval_ms`, reconnects
//! every 200 ms) reach this node and renew its lease first, so the node does
//! not campaign the moment it is back.
//!
//! Safety does not depend on any of this: switching elections off never lets
//! two leaders exist or a decision change; it can only delay an election. A
//! node that reaches a quorum always gets its elections back, so a majority
//! side still elects a leader (invariant 6); with all voters healthy
//! elections stay on, and a leader crash is handled exactly as without the
//! probe. `raft.quorum_probe_interval_ms = 0` switches the probe off.
//!
//! Each answer is also written down ([`PeerContacts`]): when this node last
//! heard from each voter is what `ClusterStatus` shows as the members'
//! reach on the leader (`raft::serving`).

use std::collections::BTreeSet;
use std::collections::HashMap;
use std::net::IpAddr;
use std::net::SocketAddr;
use std::time::Duration;

use dtx_proto::v1::raft_transport_client::RaftTransportClient;
use dtx_proto::v1::ProbeRequest;
use dtx_transport::channel::Channel;
use tokio::time::Instant;
use tracing::info;
use tracing::warn;

use super::network::CLUSTER_ID_HEADER;
use super::network::FROM_NODE_HEADER;
use super::serving::PeerContacts;
use super::NodeId;
use super::Raft;
use crate::config::Config;

/// Starts the probe for `raft` (a no-op when `raft.quorum_probe_interval_ms`
/// is 0). Elections are off from here until a quorum has answered; the task
/// ends when Raft shuts down. Every answer is recorded in `contacts`.
pub fn spawn(
    raft: Raft,
    config: &Config,
    tls: Option<std::sync::Arc<dtx_tls::ClientTls>>,
    contacts: PeerContacts,
) -> Option<tokio::task::JoinHandle<()>> {
    let interval = Duration::from_millis(config.raft.quorum_probe_interval_ms);
    if interval.is_zero() {
        return None;
    }
    raft.runtime_config().elect(false);
    metrics::gauge!("dtx_raft_elections_enabled").set(0.0);
    let probe = Probe {
        raft,
        cluster_id: config.cluster_id.clone(),
        local_ip: config
            .raft_addr
            .parse::<SocketAddr>()
            .ok()
            .map(|a| a.ip())
            .filter(|ip| !ip.is_unspecified()),
        interval,
        grace: Duration::from_millis(config.raft.election_timeout_max_ms),
        channels: HashMap::new(),
        tls,
        contacts,
    };
    Some(tokio::spawn(probe.run()))
}

struct Probe {
    raft: Raft,
    cluster_id: String,
    local_ip: Option<IpAddr>,
    interval: Duration,
    /// How long a quorum must have answered before elections come back.
    grace: Duration,
    channels: HashMap<String, Channel>,
    tls: Option<std::sync::Arc<dtx_tls::ClientTls>>,
    /// When each voter last answered.
    contacts: PeerContacts,
}

/// What one round found.
struct Round {
    me: NodeId,
    /// Every voter set of the membership (two during a joint change).
    configs: Vec<BTreeSet<NodeId>>,
    /// Voters that answered, this node included.
    answered: BTreeSet<NodeId>,
}

impl Round {
    fn is_voter(&self) -> bool {
        self.configs.iter().any(|c| c.contains(&self.me))
    }

    fn alone(&self) -> bool {
        self.configs.iter().all(|c| c.iter().all(|v| *v == self.me))
    }

    fn quorum(&self) -> bool {
        self.configs
            .iter()
            .all(|c| c.iter().filter(|v| self.answered.contains(v)).count() * 2 > c.len())
    }

    fn voters(&self) -> usize {
        self.configs.iter().flatten().collect::<BTreeSet<_>>().len()
    }
}

impl Probe {
    async fn run(mut self) {
        let raft_metrics = self.raft.metrics();
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut enabled = false;
        let mut quorum_since: Option<Instant> = None;
        loop {
            tick.tick().await;
            if raft_metrics.has_changed().is_err() {
                return; // Raft has shut down.
            }
            let round = self.round().await;
            let now = Instant::now();
            let want = if !round.is_voter() || round.alone() {
                // A learner never campaigns anyway; a single voter is its
                // own quorum.
                true
            } else if round.quorum() {
                // The grace applies to switching elections on; a node whose
                // elections are on and that reaches a quorum keeps them.
                let since = *quorum_since.get_or_insert(now);
                enabled || now.duration_since(since) >= self.grace
            } else {
                quorum_since = None;
                false
            };
            if want == enabled {
                continue;
            }
            enabled = want;
            self.raft.runtime_config().elect(want);
            metrics::gauge!("dtx_raft_elections_enabled").set(if want { 1.0 } else { 0.0 });
            if want {
                info!(
                    answered = round.answered.len(),
                    voters = round.voters(),
                    "elections on: a quorum of voters answers"
                );
            } else {
                metrics::counter!("dtx_raft_elections_switched_off_total").increment(1);
                warn!(
                    answered = round.answered.len(),
                    voters = round.voters(),
                    "elections off: this node reaches no quorum of voters, so it does not campaign \
                     (its term stays; they come back once a quorum answers)"
                );
            }
        }
    }

    /// Asks every other voter once, all at the same time, each for at most
    /// twice the probe interval.
    async fn round(&mut self) -> Round {
        let (me, configs, targets) = {
            let m = self.raft.metrics();
            let m = m.borrow();
            let membership = m.membership_config.membership();
            let configs = membership.get_joint_config().clone();
            let voters: BTreeSet<NodeId> = configs.iter().flatten().copied().collect();
            let targets: Vec<(NodeId, String)> = voters
                .into_iter()
                .filter(|v| *v != m.id)
                .filter_map(|v| membership.get_node(&v).map(|n| (v, n.raft_addr.clone())))
                .collect();
            (m.id, configs, targets)
        };
        let timeout = self.interval * 2;
        let calls: Vec<_> = targets
            .into_iter()
            .filter_map(|(id, addr)| {
                let ch = self.channel(&addr, timeout)?;
                Some(self.ask(ch, id, timeout))
            })
            .collect();
        let mut answered: BTreeSet<NodeId> = futures::future::join_all(calls).await.into_iter().flatten().collect();
        answered.insert(me);
        Round { me, configs, answered }
    }

    fn channel(&mut self, addr: &str, connect_timeout: Duration) -> Option<Channel> {
        if let Some(c) = self.channels.get(addr) {
            return Some(c.clone());
        }
        // The same source address as Raft's own traffic, so a partition
        // that cuts Raft off cuts the probe off too.
        let c = dtx_transport::channel::channel_with(addr, self.local_ip, connect_timeout, self.tls.as_ref()).ok()?;
        self.channels.insert(addr.to_string(), c.clone());
        Some(c)
    }

    /// `Some(id)` when voter `id` itself answered in time (written down in
    /// the contacts as it arrives).
    fn ask(&self, ch: Channel, id: NodeId, timeout: Duration) -> impl std::future::Future<Output = Option<NodeId>> {
        let mut req = tonic::Request::new(ProbeRequest {});
        req.set_timeout(timeout);
        let md = req.metadata_mut();
        if let Ok(v) = self.cluster_id.parse() {
            md.insert(CLUSTER_ID_HEADER, v);
        }
        let me = self.raft.metrics().borrow().id;
        md.insert(FROM_NODE_HEADER, me.into());
        let contacts = self.contacts.clone();
        async move {
            let answered = match tokio::time::timeout(timeout, RaftTransportClient::new(ch).probe(req)).await {
                Ok(Ok(r)) if r.get_ref().node_id == id => Some(id),
                // A node of an older build has no Probe, but it answered.
                Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => Some(id),
                _ => None,
            };
            if answered.is_some() {
                contacts.heard(id, Instant::now());
            }
            answered
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(me: NodeId, configs: &[&[NodeId]], answered: &[NodeId]) -> Round {
        Round {
            me,
            configs: configs.iter().map(|c| c.iter().copied().collect()).collect(),
            answered: answered.iter().copied().chain([me]).collect(),
        }
    }

    #[test]
    fn quorum_is_a_majority_of_every_voter_set() {
        assert!(!round(1, &[&[1, 2, 3]], &[]).quorum());
        assert!(round(1, &[&[1, 2, 3]], &[2]).quorum());
        assert!(round(1, &[&[1, 2, 3]], &[3]).quorum());
        // Four voters: two are not a majority.
        assert!(!round(1, &[&[1, 2, 3, 4]], &[2]).quorum());
        assert!(round(1, &[&[1, 2, 3, 4]], &[2, 3]).quorum());
        // Joint change {1,2,3} -> {3,4,5}: a majority of both.
        assert!(!round(3, &[&[1, 2, 3], &[3, 4, 5]], &[1]).quorum());
        assert!(round(3, &[&[1, 2, 3], &[3, 4, 5]], &[1, 4]).quorum());
        // A voter that is not in the membership does not count.
        assert!(!round(1, &[&[1, 2, 3]], &[9]).quorum());
    }

    #[test]
    fn learners_and_single_voters_keep_elections() {
        let learner = round(4, &[&[1, 2, 3]], &[]);
        assert!(!learner.is_voter());
        let single = round(1, &[&[1]], &[]);
        assert!(single.alone() && single.quorum());
        assert!(!round(1, &[&[1, 2]], &[]).alone());
    }
}
