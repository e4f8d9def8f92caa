//! Which node leads a Raft cluster, and in which term, before and after each
//! measured phase of the bench.
//!
//! A phase is a fair measure of a system only if its leader stayed put: a
//! leader that steps down mid-phase (for example because a shared disk
//! stalled its log's fsync past the election timeout) costs an election,
//! and clients that kept talking to the old leader pay a forwarding hop on
//! every call afterwards. So the bench finds the leader before each phase,
//! puts it first in its clients' endpoints (the client follows the
//! leader's hint from there, as an application's client does), and
//! records a phase whose term changed, which the report then refuses to
//! judge a goal on. Both systems are watched: ours through
//! `Admin.ClusterStatus`, etcd through `Maintenance.Status`
//! ([`crate::etcd::EtcdCluster::leader`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use dtx_testkit::node_metrics::LeaderWork;

/// The leader as the node that leads reports itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leader {
    /// Our node id, or etcd's member id.
    pub id: u64,
    pub term: u64,
    /// The client address it was reached at.
    pub addr: String,
}

/// How long [`LeaderWatch::find`] waits for some node to answer as leader
/// (an election in progress) before it gives up.
pub const FIND_LEADER_WITHIN: Duration = Duration::from_secs(10);

/// Our cluster's API addresses and the identity that may read its status
/// (`Admin.ClusterStatus` is for operators when the cluster runs TLS).
#[derive(Clone)]
pub struct LeaderWatch {
    api: Vec<String>,
    tls: Option<Arc<dtx_tls::ClientTls>>,
    /// Each node's metrics port, by node id, where it has one.
    metrics: HashMap<u64, String>,
}

impl LeaderWatch {
    pub fn new(api: Vec<String>, tls: Option<Arc<dtx_tls::ClientTls>>) -> Self {
        LeaderWatch {
            api,
            tls,
            metrics: HashMap::new(),
        }
    }

    /// With each node's metrics port (node id, address), so that
    /// [`LeaderWatch::samples_of`] can read the leader's counters.
    pub fn with_metrics(mut self, metrics: impl IntoIterator<Item = (u64, String)>) -> Self {
        self.metrics = metrics.into_iter().collect();
        self
    }

    /// The samples of `leader`'s metrics port; `None` without a leader, a
    /// metrics port, or an answer.
    pub async fn samples_of(&self, leader: Option<&Leader>) -> Option<HashMap<String, f64>> {
        let addr = self.metrics.get(&leader?.id)?;
        let text = dtx_testkit::node_metrics::scrape(addr).await.ok()?;
        Some(dtx_testkit::node_metrics::samples(&text))
    }

    /// The node that answers `ClusterStatus` as leader ([`first_leader`]).
    pub async fn find(&self) -> Option<Leader> {
        first_leader(&self.api, |addr| async move {
            let s = dtx_client::cluster_status_with(&addr, ASK_TIMEOUT, self.tls.as_ref())
                .await
                .ok()?;
            (s.role == "Leader" && s.leader_id == s.node_id).then_some(Leader {
                id: s.node_id,
                term: s.term,
                addr,
            })
        })
        .await
    }

    /// Starts reading what `leader` does over a phase: its counters now
    /// ([`LeaderWatch::samples_of`]) and the clock.
    pub async fn work_from(&self, leader: Option<&Leader>) -> WorkFrom {
        WorkFrom {
            samples: self.samples_of(leader).await,
            started: Instant::now(),
        }
    }

    /// Every API address, `leader`'s first: a client starts at the leader
    /// and can still follow a new leader's hint to any other node.
    pub fn leader_first(&self, leader: Option<&Leader>) -> Vec<String> {
        leader_first(&self.api, leader.map(|l| l.addr.as_str()))
    }
}

/// How long one node may take to say whether it leads.
pub const ASK_TIMEOUT: Duration = Duration::from_millis(500);

/// The first of `addrs` whose node, asked by `ask`, says it leads; every
/// address asked in turn, again every 100 ms until
/// [`FIND_LEADER_WITHIN`]; `None` when none did. Ours and etcd's
/// ([`crate::etcd::EtcdCluster::leader`]) differ only in `ask`.
pub async fn first_leader<F, Fut>(addrs: &[String], ask: F) -> Option<Leader>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Option<Leader>>,
{
    let until = Instant::now() + FIND_LEADER_WITHIN;
    loop {
        for addr in addrs {
            if let Some(l) = ask(addr.clone()).await {
                return Some(l);
            }
        }
        if Instant::now() >= until {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The leader's counters and the clock at the start of a phase
/// ([`LeaderWatch::work_from`]).
pub struct WorkFrom {
    samples: Option<HashMap<String, f64>>,
    started: Instant,
}

impl WorkFrom {
    /// What `leader` did since, for calls of `method`
    /// ([`LeaderWork::between`]); `None` without its counters at either end.
    pub async fn until_now(self, watch: &LeaderWatch, leader: Option<&Leader>, method: &str) -> Option<LeaderWork> {
        let elapsed = self.started.elapsed();
        let after = watch.samples_of(leader).await?;
        LeaderWork::between(&self.samples?, &after, elapsed, method)
    }
}

/// `addrs` with `first` moved to the front (unchanged when it is not
/// among them).
pub fn leader_first(addrs: &[String], first: Option<&str>) -> Vec<String> {
    let mut out: Vec<String> = addrs.to_vec();
    if let Some(i) = first.and_then(|f| out.iter().position(|a| a == f)) {
        let a = out.remove(i);
        out.insert(0, a);
    }
    out
}

/// What changed between the leader found before a phase and the one found
/// after it, in words; `None` when the same term held throughout (the
/// only way a term-based check can say "no election happened"). A leader
/// not found on either side counts as a change: the phase cannot be shown
/// to have had one leader.
pub fn change(before: Option<&Leader>, after: Option<&Leader>) -> Option<String> {
    match (before, after) {
        (Some(b), Some(a)) if b.term == a.term && b.id == a.id => None,
        (Some(b), Some(a)) => Some(format!(
            "leader changed during the phase: term {} -> {}, leader {} -> {}",
            b.term, a.term, b.id, a.id
        )),
        (Some(b), None) => Some(format!(
            "no leader found after the phase (term {}, leader {} before it)",
            b.term, b.id
        )),
        (None, _) => Some("no leader found before the phase".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(id: u64, term: u64) -> Leader {
        Leader {
            id,
            term,
            addr: format!("127.0.0.1:{id}"),
        }
    }

    #[test]
    fn the_same_term_and_leader_is_no_change() {
        assert_eq!(change(Some(&l(1, 4)), Some(&l(1, 4))), None);
    }

    #[test]
    fn a_new_term_or_a_missing_leader_is_a_change_in_words() {
        assert_eq!(
            change(Some(&l(1, 4)), Some(&l(3, 5))).as_deref(),
            Some("leader changed during the phase: term 4 -> 5, leader 1 -> 3")
        );
        // Re-elected in a new term: still an election mid-phase.
        assert!(change(Some(&l(1, 4)), Some(&l(1, 6))).is_some());
        assert!(change(Some(&l(1, 4)), None).unwrap().contains("no leader found after"));
        assert!(change(None, Some(&l(1, 4))).unwrap().contains("before the phase"));
    }

    #[test]
    fn the_leader_goes_first_and_nothing_is_lost() {
        let addrs: Vec<String> = ["a:1", "b:2", "c:3"].iter().map(|s| s.to_string()).collect();
        assert_eq!(leader_first(&addrs, Some("c:3")), ["c:3", "a:1", "b:2"]);
        assert_eq!(leader_first(&addrs, Some("a:1")), addrs);
        assert_eq!(leader_first(&addrs, Some("elsewhere:9")), addrs);
        assert_eq!(leader_first(&addrs, None), addrs);
    }
}
