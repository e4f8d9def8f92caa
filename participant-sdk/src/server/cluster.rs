//! Asking the cluster about decisions: [`RecoveryOptions`] (how recovery
//! and log garbage collection run, and the [`Client`] they ask with), and
//! the one question per incarnation both of them ask.

use std::sync::Arc;
use std::time::Duration;

use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_client::DecisionAnswer;

use crate::log::GlobalTxid;

/// The transactions of `items` by incarnation (ascending), each group in
/// the order given: the cluster is asked once per incarnation.
pub(super) fn by_incarnation<T: Copy>(items: &[T], txid: impl Fn(&T) -> GlobalTxid) -> Vec<(u64, Vec<T>)> {
    let mut groups: std::collections::BTreeMap<u64, Vec<T>> = std::collections::BTreeMap::new();
    for it in items {
        groups.entry(txid(it).incarnation).or_default().push(*it);
    }
    groups.into_iter().collect()
}

/// The cluster's answer for each of `txids` of `incarnation`, in order
/// ([`Client::decisions_in`]: linearizable, batched, any node, with the
/// client's retries); an error (no answer before the client's deadline)
/// as text.
pub(super) async fn ask(
    client: &Client,
    incarnation: u64,
    txids: &[u64],
    participant_id: &str,
) -> Result<Vec<DecisionAnswer>, String> {
    client
        .decisions_in(incarnation, txids, participant_id)
        .await
        .map_err(|e| e.to_string())
}

/// How the recovery loop runs.
#[derive(Clone, Debug)]
pub struct RecoveryOptions {
    /// Time between passes.
    pub interval: Duration,
    /// After the first pass (which asks about every in-doubt transaction),
    /// ask only about YES votes at least this old: younger ones are normally
    /// still in the coordinator's hands.
    pub prepared_age_min: Duration,
    /// Decided log records and READ_ONLY votes older than this are
    /// garbage-collected once the cluster will send nothing more for them
    /// (`collect_decided`); `None` keeps them forever. Keep it far above any
    /// transaction timeout.
    pub log_retention: Option<Duration>,
    /// Time between garbage-collection passes (each may ask the cluster
    /// about up to 10,000 records).
    pub gc_interval: Duration,
    /// Source address for the connections to the cluster (the service's
    /// own address, so network rules on it apply both ways); `None` lets
    /// the system choose.
    pub local_ip: Option<std::net::IpAddr>,
    /// This participant's id, as enlisted (the one given to
    /// `ParticipantServer::new`): log garbage collection asks the cluster
    /// whether it still awaits this participant's ack. Empty: no garbage
    /// collection (said once at start, at error level).
    pub participant_id: String,
    /// Time budget of one question to the cluster (one batch of up to 1024
    /// txids), retries at other nodes included. When it runs out the pass
    /// logs that the cluster is not answering, and the next pass asks
    /// again.
    pub ask_timeout: Duration,
    /// TLS settings of the calls to the cluster (its authority, and this
    /// service's certificate, `dtx://participant/<name>`).
    pub tls: Option<std::sync::Arc<dtx_tls::ClientTls>>,
    /// A bearer token for the calls to the cluster, where it accepts
    /// tokens instead of client certificates.
    pub token: Option<String>,
}

impl Default for RecoveryOptions {
    fn default() -> Self {
        RecoveryOptions {
            interval: Duration::from_millis(500),
            prepared_age_min: Duration::from_secs(1),
            log_retention: Some(Duration::from_secs(24 * 3600)),
            gc_interval: Duration::from_secs(10),
            local_ip: None,
            participant_id: String::new(),
            ask_timeout: Duration::from_secs(2),
            tls: None,
            token: None,
        }
    }
}

impl RecoveryOptions {
    /// The options of a service that is participant `participant_id` and
    /// listens on `listen`: passes every 500 ms, asking the cluster from
    /// the listening address's IP (unless it is unspecified), so network
    /// rules on that address cut the service both ways.
    pub fn for_service(participant_id: &str, listen: &str) -> Self {
        let local_ip = listen
            .parse::<std::net::SocketAddr>()
            .ok()
            .map(|sa| sa.ip())
            .filter(|ip| !ip.is_unspecified());
        RecoveryOptions {
            interval: Duration::from_millis(500),
            local_ip,
            participant_id: participant_id.to_string(),
            ..RecoveryOptions::default()
        }
    }

    pub(super) fn with_local_ip(local_ip: Option<std::net::IpAddr>) -> Self {
        RecoveryOptions {
            local_ip,
            ..RecoveryOptions::default()
        }
    }

    /// The settings of the [`Client`] that recovery and garbage collection
    /// ask the cluster (`endpoints`) with: the client's retry policy
    /// (leader hints, other nodes, backoff with jitter) within
    /// `ask_timeout` per question, connections opened within 500 ms, from
    /// `local_ip`.
    pub fn client_config(&self, endpoints: Vec<String>) -> ClientConfig {
        let mut cfg = ClientConfig::new(endpoints);
        cfg.call_deadline = self.ask_timeout;
        cfg.attempt_timeout = self.ask_timeout;
        cfg.connect_timeout = Duration::from_millis(500);
        cfg.local_ip = self.local_ip;
        cfg.tls = self.tls.clone();
        cfg.token = self.token.clone();
        cfg
    }

    /// A client of [`client_config`](RecoveryOptions::client_config).
    pub(super) fn client(&self, endpoints: &[String]) -> Result<Arc<Client>, String> {
        Client::new(self.client_config(endpoints.to_vec()))
            .map(Arc::new)
            .map_err(|e| e.to_string())
    }
}
