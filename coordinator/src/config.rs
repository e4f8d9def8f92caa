//! Node configuration: a TOML file, every field with a default, checked by
//! `validate()` before anything starts. Command-line flags override the file.
//! The example `etc/coordinator.example.toml` is parsed by a test.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("config file {path} is not valid: {message}")]
    Parse { path: String, message: String },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Member {
    pub id: u64,
    pub raft_addr: String,
    pub api_addr: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// This node's id, unique in the cluster, never reused, > 0.
    pub node_id: u64,
    /// Name of the cluster; recorded in the data directory and checked on
    /// every Raft call. ASCII letters, digits, '-', '_', '.'.
    pub cluster_id: String,
    /// Where this node keeps its log, state machine and snapshots.
    pub data_dir: PathBuf,
    /// Listen address of the Raft transport (node to node).
    pub raft_addr: String,
    /// Listen address of the client and admin API.
    pub api_addr: String,
    /// Prometheus exporter listen address; leave the key out to disable it.
    pub metrics_addr: Option<String>,
    /// Serve the read-only web console under `/console` on `metrics_addr`
    /// (`crate::console`). The port has no authentication and the console
    /// shows transaction ids, participant ids, addresses and notes: keep
    /// `metrics_addr` on a management network, or turn this off (then
    /// `/console...` answers 404).
    pub console_enabled: bool,
    pub bootstrap: BootstrapConfig,
    pub raft: RaftConfig,
    pub batch: BatchConfig,
    pub txn: TxnConfig,
    /// The saga orchestrator (ADR 0019).
    pub saga: SagaConfig,
    pub api: ApiConfig,
    pub tls: TlsConfig,
    pub auth: AuthConfig,
    /// What applications may enlist (ADR 0041).
    pub participants: ParticipantsConfig,
}

/// Which participants applications may enlist (ADR 0041).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ParticipantsConfig {
    /// The participant addresses Enlist and BeginAndCommit accept: IP
    /// networks (`10.0.0.0/8`, `fd00::/8`, one address `10.1.2.3`) for
    /// hosts given as IP literals, host-name patterns
    /// (`bank-*.svc.internal`, `*` within one label) for names
    /// (`crate::participant_policy`). Others are refused PERMISSION_DENIED
    /// before anything is proposed. Empty (the default) = any address.
    /// Set it the same on every node (the leader checks).
    pub allowed_addresses: Vec<String>,
}

/// The leader's saga orchestrator (ADR 0019).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SagaConfig {
    /// Longest wait for a step service's answer to one call (forward,
    /// compensation or status query); past it the outcome is UNKNOWN.
    pub call_timeout_ms: u64,
    /// How often the leader looks for sagas to drive (a new saga and an
    /// operator's action wake it at once).
    pub scan_interval_ms: u64,
    /// Sagas driven at once at most; the others wait for a free slot.
    pub sagas_in_flight_max: usize,
    /// How long an ended saga (COMPLETED or COMPENSATED) is kept before the
    /// leader forgets it (and its idempotency key). Parked sagas are never
    /// forgotten.
    pub retention_ms: u64,
    /// The recovery policy's rules (`[[saga.policy_rules]]`, docs/sagas.md
    /// "Recovery policy"): for a failed step, the order of its registered
    /// recovery options and the words an escalation carries; for a
    /// compensation, whether it waits for an approval. The first rule that
    /// matches decides; none: the definition's registered order. A rule
    /// never adds an option the definition did not register.
    pub policy_rules: Vec<SagaPolicyRule>,
}

impl Default for SagaConfig {
    fn default() -> Self {
        SagaConfig {
            call_timeout_ms: 2_000,
            scan_interval_ms: 200,
            sagas_in_flight_max: 256,
            retention_ms: 7 * 24 * 3_600_000,
            policy_rules: Vec::new(),
        }
    }
}

/// One rule of the saga recovery policy. Empty match fields match
/// everything.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct SagaPolicyRule {
    /// The definition's name this rule is about; empty: every definition.
    pub definition: String,
    /// The step's name; empty: every step.
    pub step: String,
    /// Matches a failed step only when its failure's reason contains this
    /// text; empty: any reason. (Compensation approvals ignore it.)
    pub reason_contains: String,
    /// The recovery options to try, in order: "RETRY", "COMPENSATE",
    /// "PARK". Only those the step registered are ever taken. Empty: the
    /// registered order.
    pub recovery: Vec<String>,
    /// The matching steps' compensations wait for an approval (as if their
    /// definition marked them high-impact).
    pub approve_compensation: bool,
    /// Said first when a matching step's saga parks for an operator (whom
    /// to call, what to check); empty: the orchestrator's words only.
    pub escalation: String,
}

/// The recovery options a policy rule may name.
pub const SAGA_RECOVERY_NAMES: [&str; 3] = ["RETRY", "COMPENSATE", "PARK"];

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct BootstrapConfig {
    /// When true and the data directory is new, this node initializes a new
    /// cluster with `members` (which must include this node). Set it on ONE
    /// node of a new cluster only.
    pub enabled: bool,
    pub members: Vec<Member>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RaftConfig {
    pub heartbeat_interval_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// Build a snapshot after this many applied entries since the last one.
    pub snapshot_logs_since_last: u64,
    /// Entries kept in the log behind a snapshot (for lagging followers).
    pub logs_to_keep_after_snapshot: u64,
    /// Raft entries per AppendEntries call.
    pub append_entries_max: u64,
    /// Largest Raft message accepted or sent, in bytes.
    pub max_message_bytes: usize,
    /// Snapshot chunk size, in bytes.
    pub snapshot_chunk_bytes: u64,
    pub connect_timeout_ms: u64,
    /// How often this node checks that it reaches a quorum of voters over
    /// the Raft transport; while it does not, it does not campaign (its term
    /// stays, and it cannot depose the leader when it comes back). Each
    /// probe waits at most twice this long. 0 = no probe: openraft's own
    /// election timer alone (docs/adr/0008-disruptive-rejoins.md).
    pub quorum_probe_interval_ms: u64,
    /// An AppendEntries that would carry a follower only a newer commit
    /// index (or a heartbeat) is not sent while that follower accepted one
    /// at the same place less than this long ago: it learns the commit
    /// index from its next AppendEntries (docs/adr/0031). 0 = every one is
    /// sent. The window used is never longer than
    /// (election_timeout_min_ms - heartbeat_interval_ms) / 2
    /// ([`RaftConfig::commit_index_defer_window`]), so a follower hears from
    /// its leader well within an election timeout whatever the timings.
    pub commit_index_defer_max_ms: u64,
}

impl RaftConfig {
    /// The window of `commit_index_defer_max_ms` in use: that setting, cut
    /// to half of what an election timeout leaves after a heartbeat
    /// interval. A follower hears from its leader at least every heartbeat
    /// interval plus this window, which thus stays below
    /// `election_timeout_min_ms`.
    pub fn commit_index_defer_window(&self) -> std::time::Duration {
        let bound = self.election_timeout_min_ms.saturating_sub(self.heartbeat_interval_ms) / 2;
        std::time::Duration::from_millis(self.commit_index_defer_max_ms.min(bound))
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BatchConfig {
    /// Most commands in one Raft entry.
    pub entries_max: usize,
    /// Most encoded bytes in one Raft entry.
    pub bytes_max: usize,
    /// Longest wait for more commands once a batch could leave, in µs.
    pub wait_us: u64,
    /// Raft entries proposed but not yet applied, at most.
    pub inflight_max: usize,
    /// Under load, the longest a batch waits for each next caller, in µs
    /// (4 times this in all), until it holds as many callers as the largest
    /// of the last few batches (0 = never). Applies only when that largest
    /// batch held at least `refill_callers_min` callers.
    pub refill_wait_us: u64,
    /// Callers in a recent batch from which a batch waits to be refilled
    /// (`refill_wait_us`); below it a batch never waits.
    pub refill_callers_min: usize,
    /// Commands waiting for a batch, at most; beyond it calls get UNAVAILABLE.
    pub queue_max: usize,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TxnConfig {
    /// Timeout used when Begin asks for 0.
    pub default_timeout_ms: u64,
    /// Largest timeout a Begin may ask for.
    pub max_timeout_ms: u64,
    /// How long a decided, fully acked record is kept before Forget.
    pub retention_ms: u64,
    /// How often the leader scans for expired and forgettable transactions.
    pub reaper_interval_ms: u64,
    /// Most Decide/Forget commands the leader's loops propose per scan (the
    /// deadline reaper's ABORTs and Forgets). Deliveries and re-drives are
    /// not limited per scan: every one without a task gets one.
    pub reaper_batch_max: usize,
    /// Longest wait for all Prepare votes (also bounded by the deadline).
    pub prepare_timeout_ms: u64,
    /// First delay between phase-two delivery attempts; doubles, with jitter.
    pub delivery_retry_base_ms: u64,
    /// Largest delay between phase-two delivery attempts.
    pub delivery_retry_max_ms: u64,
    /// Phase-two calls in flight to one participant address at most; the
    /// rest wait their turn (a new leader may start thousands at once).
    pub delivery_inflight_calls_max: u32,
    /// Participant acks wait up to this long to go through Raft together in
    /// one entry (0 = as soon as possible, still grouped with whatever waits).
    pub ack_batch_wait_ms: u64,
    /// Phase two in groups: a decision for a participant address with no
    /// `ApplyDecisions` message in flight waits up to this long for others
    /// to share its message (0 = send what is queued at once). While a
    /// message is in flight, decisions for that address queue up for the
    /// next one anyway.
    pub delivery_batch_wait_us: u64,
    /// Commit a transaction with a single participant in one phase (one
    /// message, no separate prepare round).
    pub one_phase_commit: bool,
    /// BeginAndCommit with one Raft write between the votes and the answer
    /// (the record and its decision together, ADR 0012). Off: the record
    /// is written in PREPARING first, then the decision.
    pub one_write_commit: bool,
    /// Txids one `ReserveTxids` hands the leader for one-write commits
    /// (one Raft write per this many transactions).
    pub txid_reserve_count: u64,
    /// How long this leader keeps calling, for one transaction, a
    /// participant address that has never answered any call from this node
    /// process (ADR 0041): past it, the delivery of an
    /// ABORT and the re-sending of a one-phase commit stop (shown to
    /// operators; resumed if the address answers any call). COMMIT
    /// deliveries never stop. 0 = never stop.
    pub never_answered_give_up_ms: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ApiConfig {
    /// Longest time a linearizable read waits for the read-index round.
    pub read_timeout_ms: u64,
    /// Longest time a write waits to be applied before answering
    /// DEADLINE_EXCEEDED (outcome unknown).
    pub write_timeout_ms: u64,
    /// Largest request the API port decodes (a BeginAndCommit with 32
    /// participants of 64 KiB payload each is about 2 MiB); larger ones are
    /// refused OUT_OF_RANGE before anything runs.
    pub max_message_bytes: usize,
    /// Calls in flight at once on one client connection (HTTP/2 streams);
    /// a client past it waits for one to finish.
    pub max_concurrent_streams_per_connection: u32,
    /// Calls per second each authenticated identity may make (nodes
    /// excepted); past it a call is refused RESOURCE_EXHAUSTED, marked not
    /// applied. 0 = no limit. Without authentication there is no identity
    /// and no limit.
    pub requests_per_s_per_identity: u32,
    /// Calls an identity may make at once after a quiet time.
    pub request_burst_per_identity: u32,
}

/// TLS on every link of this node (ADR 0016). Off unless `cert`, `key` and
/// `ca` are all set; then the API port, the Raft port and this node's
/// calls to other nodes and to participants all use TLS, with this node's
/// certificate as its identity (`dtx://node/<node_id>`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// PEM: this node's certificate (then any intermediates).
    pub cert: Option<PathBuf>,
    /// PEM: its private key.
    pub key: Option<PathBuf>,
    /// PEM: the authority every peer's certificate must come from.
    pub ca: Option<PathBuf>,
    /// The API port: "required" (every caller presents a certificate:
    /// mutual TLS) or "optional" (callers without one authenticate with a
    /// bearer token from `auth.tokens`). The Raft port always requires a
    /// node's certificate.
    pub client_auth: String,
    /// Every this many ms the files are checked and, when changed, read
    /// again (new connections use them; a bad new file is logged and the
    /// old settings kept). 0 = never.
    pub reload_interval_ms: u64,
}

impl TlsConfig {
    pub fn enabled(&self) -> bool {
        self.cert.is_some()
    }
}

impl Default for TlsConfig {
    fn default() -> Self {
        TlsConfig {
            cert: None,
            key: None,
            ca: None,
            client_auth: "required".to_string(),
            reload_interval_ms: 10_000,
        }
    }
}

/// Who may call the API. Authentication is on when TLS is on or tokens are
/// configured; then every call needs an identity (a client certificate's
/// `dtx://<role>/<name>`, or a token below) whose role may make it
/// (docs/api.md, "Who may call what").
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    pub tokens: Vec<TokenConfig>,
    /// A file holding the token this node sends to participants with every
    /// call (`authorization: Bearer`), for participants served without
    /// mutual TLS that check it (`--accept-node-token-sha256`). With TLS
    /// the node's certificate is its proof and this is not needed.
    pub participant_token_file: Option<PathBuf>,
    /// Participants that may enlist themselves (ADR 0037): a
    /// participant identity enlists only its own id (its name), and only in
    /// a transaction of an application listed with it here (or one whose
    /// owner enlisted it already).
    pub self_enlist: Vec<SelfEnlistConfig>,
}

/// One participant allowed to enlist itself in the transactions of the
/// applications named.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SelfEnlistConfig {
    /// The participant's identity name (`dtx://participant/<name>`, or a
    /// participant token's name), which is also the id it enlists as.
    pub participant: String,
    /// The applications (owners) whose transactions it may enlist in.
    pub applications: Vec<String>,
}

/// One accepted bearer token: the SHA-256 of the token (64 hex digits;
/// never the token) and the identity it stands for.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    /// application, participant, operator or node.
    pub role: String,
    pub name: String,
    pub sha256: String,
}

impl TokenConfig {
    /// This token, checked: its role, its name and its digest.
    pub fn entry(&self) -> Result<dtx_tls::TokenEntry, String> {
        let role = dtx_tls::Role::parse(&self.role)?;
        dtx_tls::identity::check_name(&self.name)?;
        if role == dtx_tls::Role::Node {
            return Err(format!(
                "the token for {:?} has role \"node\", which a token cannot carry: a node proves itself with its certificate (dtx://node/<id>) and is honoured only as a current member; use application, participant or operator",
                self.name
            ));
        }
        dtx_tls::TokenEntry::new(role, &self.name, &self.sha256)
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            node_id: 1,
            cluster_id: "dtx".to_string(),
            data_dir: PathBuf::from("data/node1"),
            raft_addr: "127.0.0.1:7101".to_string(),
            api_addr: "127.0.0.1:7201".to_string(),
            metrics_addr: None,
            console_enabled: true,
            bootstrap: BootstrapConfig::default(),
            raft: RaftConfig::default(),
            batch: BatchConfig::default(),
            txn: TxnConfig::default(),
            saga: SagaConfig::default(),
            api: ApiConfig::default(),
            tls: TlsConfig::default(),
            auth: AuthConfig::default(),
            participants: ParticipantsConfig::default(),
        }
    }
}

impl Default for RaftConfig {
    fn default() -> Self {
        RaftConfig {
            heartbeat_interval_ms: 100,
            election_timeout_min_ms: 300,
            election_timeout_max_ms: 500,
            snapshot_logs_since_last: 20_000,
            logs_to_keep_after_snapshot: 1_000,
            append_entries_max: 64,
            max_message_bytes: 64 * 1024 * 1024,
            snapshot_chunk_bytes: 4 * 1024 * 1024,
            connect_timeout_ms: 500,
            quorum_probe_interval_ms: 100,
            commit_index_defer_max_ms: 50,
        }
    }
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            entries_max: 512,
            bytes_max: 1024 * 1024,
            wait_us: 0,
            inflight_max: 1,
            refill_wait_us: 0,
            refill_callers_min: 16,
            queue_max: 16_384,
        }
    }
}

impl Default for TxnConfig {
    fn default() -> Self {
        TxnConfig {
            default_timeout_ms: 30_000,
            max_timeout_ms: 3_600_000,
            retention_ms: 600_000,
            reaper_interval_ms: 200,
            reaper_batch_max: 256,
            prepare_timeout_ms: 5_000,
            delivery_retry_base_ms: 50,
            delivery_retry_max_ms: 2_000,
            delivery_inflight_calls_max: 64,
            ack_batch_wait_ms: 50,
            delivery_batch_wait_us: 1_000,
            one_phase_commit: true,
            one_write_commit: true,
            txid_reserve_count: 4096,
            never_answered_give_up_ms: 600_000,
        }
    }
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            read_timeout_ms: 2_000,
            write_timeout_ms: 5_000,
            max_message_bytes: 4 * 1024 * 1024,
            max_concurrent_streams_per_connection: 1024,
            requests_per_s_per_identity: 20_000,
            request_burst_per_identity: 40_000,
        }
    }
}

fn check_addr(field: &str, v: &str) -> Result<SocketAddr, ConfigError> {
    v.parse::<SocketAddr>()
        .map_err(|e| ConfigError::Invalid(format!("{field} = {v:?} is not an IP:port address: {e}")))
}

impl Config {
    pub fn from_file(path: &std::path::Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.display().to_string(),
                message,
            },
            other => other,
        })
    }

    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: "<string>".to_string(),
            message: e.to_string(),
        })
    }

    /// Checks every field; the message names the field and what is wrong.
    /// Each section checks its own fields (`validate` of the section's
    /// type); checks that join two sections say so in their names.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_node()?;
        self.saga.validate()?;
        self.api.validate()?;
        self.tls.validate()?;
        self.auth.validate()?;
        self.participants.validate()?;
        self.bootstrap.validate(self.node_id)?;
        self.raft.validate()?;
        self.batch.validate_with(&self.raft)?;
        self.txn.validate()?;
        Ok(())
    }

    /// The node's own fields: its id, cluster id, data directory and
    /// addresses.
    fn validate_node(&self) -> Result<(), ConfigError> {
        if self.node_id == 0 {
            return bad("node_id must be > 0".into());
        }
        if self.cluster_id.is_empty()
            || self.cluster_id.len() > 64
            || !self
                .cluster_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return bad(format!(
                "cluster_id {:?} must be 1..=64 characters of ASCII letters, digits, '-', '_' or '.'",
                self.cluster_id
            ));
        }
        if self.data_dir.as_os_str().is_empty() {
            return bad("data_dir must be set".into());
        }
        check_addr("raft_addr", &self.raft_addr)?;
        check_addr("api_addr", &self.api_addr)?;
        if self.raft_addr == self.api_addr {
            return bad("raft_addr and api_addr must differ".into());
        }
        if let Some(m) = &self.metrics_addr {
            check_addr("metrics_addr", m)?;
        }
        Ok(())
    }
}

/// An invalid configuration, with the message saying which field and why.
fn bad<T>(message: String) -> Result<T, ConfigError> {
    Err(ConfigError::Invalid(message))
}

impl SagaConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let g = self;
        if g.call_timeout_ms == 0 || g.scan_interval_ms == 0 || g.sagas_in_flight_max == 0 || g.retention_ms == 0 {
            return bad(format!(
                "saga.call_timeout_ms ({}), saga.scan_interval_ms ({}), saga.sagas_in_flight_max ({}) and saga.retention_ms ({}) must be > 0",
                g.call_timeout_ms, g.scan_interval_ms, g.sagas_in_flight_max, g.retention_ms
            ));
        }
        for (i, r) in g.policy_rules.iter().enumerate() {
            for o in &r.recovery {
                if !SAGA_RECOVERY_NAMES.contains(&o.as_str()) {
                    return bad(format!(
                        "saga.policy_rules[{i}].recovery: {o:?} is not one of {}",
                        SAGA_RECOVERY_NAMES.join(", ")
                    ));
                }
            }
            if r.recovery.is_empty() && !r.approve_compensation && r.escalation.is_empty() {
                return bad(format!(
                    "saga.policy_rules[{i}] changes nothing: give recovery, approve_compensation or escalation"
                ));
            }
        }
        Ok(())
    }
}

impl ApiConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let a = self;
        if a.max_message_bytes < 64 * 1024 || a.max_message_bytes > dtx_proto::limits::DECODE_BYTES_MAX {
            return bad(format!(
                "api.max_message_bytes = {} must be from 65536 to {}",
                a.max_message_bytes,
                dtx_proto::limits::DECODE_BYTES_MAX
            ));
        }
        if a.max_concurrent_streams_per_connection == 0 {
            return bad("api.max_concurrent_streams_per_connection must be > 0".into());
        }
        if a.requests_per_s_per_identity > 0 && a.request_burst_per_identity == 0 {
            return bad(
                "api.request_burst_per_identity must be > 0 when api.requests_per_s_per_identity is set".into(),
            );
        }
        if a.read_timeout_ms == 0 || a.write_timeout_ms == 0 {
            return bad("api.read_timeout_ms and api.write_timeout_ms must be > 0".into());
        }
        Ok(())
    }
}

impl TlsConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        match (&self.cert, &self.key, &self.ca) {
            (None, None, None) | (Some(_), Some(_), Some(_)) => {}
            _ => {
                return bad(
                    "tls.cert, tls.key and tls.ca must be set together (all three for TLS, none for plain text)".into(),
                )
            }
        }
        dtx_tls::ClientAuth::parse(&self.client_auth).map_err(|e| ConfigError::Invalid(format!("tls.{e}")))?;
        Ok(())
    }
}

impl AuthConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        for tok in &self.tokens {
            tok.entry()
                .map_err(|e| ConfigError::Invalid(format!("auth.tokens: {e}")))?;
        }
        let mut self_enlisting = std::collections::BTreeSet::new();
        for e in &self.self_enlist {
            dtx_tls::identity::check_name(&e.participant)
                .map_err(|m| ConfigError::Invalid(format!("auth.self_enlist: participant: {m}")))?;
            if !self_enlisting.insert(e.participant.as_str()) {
                return bad(format!(
                    "auth.self_enlist: participant {:?} is listed twice; list all its applications in one entry",
                    e.participant
                ));
            }
            if e.applications.is_empty() {
                return bad(format!(
                    "auth.self_enlist: participant {:?} names no applications",
                    e.participant
                ));
            }
            for a in &e.applications {
                dtx_tls::identity::check_name(a).map_err(|m| {
                    ConfigError::Invalid(format!(
                        "auth.self_enlist: participant {:?}: applications: {m}",
                        e.participant
                    ))
                })?;
            }
        }
        Ok(())
    }
}

impl ParticipantsConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        crate::participant_policy::AddressPolicy::parse(&self.allowed_addresses).map_err(ConfigError::Invalid)?;
        Ok(())
    }
}

impl BootstrapConfig {
    /// `node_id`: this node's id, which the members must include.
    fn validate(&self, node_id: u64) -> Result<(), ConfigError> {
        if !self.enabled {
            return Ok(());
        }
        if self.members.is_empty() {
            return bad("bootstrap.enabled needs bootstrap.members".into());
        }
        let mut ids = std::collections::BTreeSet::new();
        for m in &self.members {
            if m.id == 0 || !ids.insert(m.id) {
                return bad(format!("bootstrap.members: node id {} is 0 or repeated", m.id));
            }
            check_addr("bootstrap.members.raft_addr", &m.raft_addr)?;
            check_addr("bootstrap.members.api_addr", &m.api_addr)?;
        }
        if !ids.contains(&node_id) {
            return bad(format!("bootstrap.members must include this node (node_id {node_id})"));
        }
        Ok(())
    }
}

impl RaftConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let r = self;
        if r.heartbeat_interval_ms == 0 || r.election_timeout_min_ms <= r.heartbeat_interval_ms {
            return bad(format!(
                "raft.election_timeout_min_ms ({}) must be greater than raft.heartbeat_interval_ms ({}) > 0",
                r.election_timeout_min_ms, r.heartbeat_interval_ms
            ));
        }
        if r.election_timeout_max_ms <= r.election_timeout_min_ms {
            return bad("raft.election_timeout_max_ms must be greater than raft.election_timeout_min_ms".into());
        }
        if r.snapshot_logs_since_last == 0 || r.append_entries_max == 0 || r.snapshot_chunk_bytes == 0 {
            return bad(
                "raft.snapshot_logs_since_last, raft.append_entries_max and raft.snapshot_chunk_bytes must be > 0"
                    .into(),
            );
        }
        if r.quorum_probe_interval_ms != 0 && r.quorum_probe_interval_ms.saturating_mul(3) > r.election_timeout_min_ms {
            // A probe round (interval + timeout of twice the interval) must
            // end before a cut-off follower's first election, which comes no
            // sooner than election_timeout_max_ms + election_timeout_min_ms.
            return bad(format!(
                "raft.quorum_probe_interval_ms ({}) must be 0 (off) or at most a third of raft.election_timeout_min_ms ({})",
                r.quorum_probe_interval_ms, r.election_timeout_min_ms
            ));
        }
        if r.max_message_bytes < 1024 * 1024 {
            return bad("raft.max_message_bytes must be at least 1048576".into());
        }
        if r.snapshot_chunk_bytes.saturating_mul(2) > r.max_message_bytes as u64 {
            return bad(format!(
                "raft.snapshot_chunk_bytes ({}) must be at most half of raft.max_message_bytes ({})",
                r.snapshot_chunk_bytes, r.max_message_bytes
            ));
        }
        Ok(())
    }
}

impl BatchConfig {
    /// `raft`: a batch of entries must fit one AppendEntries message.
    fn validate_with(&self, raft: &RaftConfig) -> Result<(), ConfigError> {
        let (b, r) = (self, raft);
        if b.entries_max == 0 || b.inflight_max == 0 || b.queue_max == 0 {
            return bad("batch.entries_max, batch.inflight_max and batch.queue_max must be > 0".into());
        }
        if b.bytes_max < 128 * 1024 || (b.bytes_max as u64) * r.append_entries_max > r.max_message_bytes as u64 {
            return bad(format!(
                "batch.bytes_max ({}) must be at least 131072 and batch.bytes_max * raft.append_entries_max must fit raft.max_message_bytes ({})",
                b.bytes_max, r.max_message_bytes
            ));
        }
        if b.wait_us > 100_000 {
            return bad("batch.wait_us must be at most 100000 (100 ms)".into());
        }
        if b.refill_wait_us > 100_000 {
            return bad(format!(
                "batch.refill_wait_us must be at most 100000 (100 ms), got {}",
                b.refill_wait_us
            ));
        }
        if b.refill_callers_min < 2 {
            return bad(format!(
                "batch.refill_callers_min must be at least 2 (a batch of one never waits), got {}",
                b.refill_callers_min
            ));
        }
        Ok(())
    }
}

impl TxnConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let t = self;
        if t.default_timeout_ms == 0 || t.default_timeout_ms > t.max_timeout_ms {
            return bad("txn.default_timeout_ms must be > 0 and <= txn.max_timeout_ms".into());
        }
        if t.txid_reserve_count == 0 || t.txid_reserve_count > crate::limits::TXID_RESERVE_COUNT_MAX {
            return bad(format!(
                "txn.txid_reserve_count ({}) must be 1..={} txids",
                t.txid_reserve_count,
                crate::limits::TXID_RESERVE_COUNT_MAX
            ));
        }
        if t.reaper_interval_ms == 0 || t.reaper_batch_max == 0 {
            return bad("txn.reaper_interval_ms and txn.reaper_batch_max must be > 0".into());
        }
        if t.delivery_inflight_calls_max == 0 {
            return bad("txn.delivery_inflight_calls_max must be > 0 (calls to one participant at a time)".into());
        }
        if t.prepare_timeout_ms == 0
            || t.delivery_retry_base_ms == 0
            || t.delivery_retry_max_ms < t.delivery_retry_base_ms
        {
            return bad(
                "txn.prepare_timeout_ms and txn.delivery_retry_base_ms must be > 0, and txn.delivery_retry_max_ms >= txn.delivery_retry_base_ms"
                    .into(),
            );
        }
        if t.ack_batch_wait_ms > 10_000 {
            return bad(format!(
                "txn.ack_batch_wait_ms must be at most 10000 (10 s), got {}",
                t.ack_batch_wait_ms
            ));
        }
        if t.delivery_batch_wait_us > 100_000 {
            return bad(format!(
                "txn.delivery_batch_wait_us must be at most 100000 (100 ms), got {}",
                t.delivery_batch_wait_us
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_example_config_parses_and_validates() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../etc/coordinator.example.toml");
        let c = Config::from_file(&path).expect("example parses");
        c.validate().expect("example validates");
        assert!(!c.bootstrap.enabled, "the example must not found a cluster by itself");
        assert_eq!(c.bootstrap.members.len(), 3);
    }

    #[test]
    fn the_console_is_on_by_default_and_can_be_turned_off() {
        assert!(Config::default().console_enabled);
        assert!(Config::from_toml("").unwrap().console_enabled);
        assert!(!Config::from_toml("console_enabled = false").unwrap().console_enabled);
    }

    #[test]
    fn defaults_validate() {
        Config::default().validate().unwrap();
    }

    /// A token cannot carry the node role, and identity names in the
    /// configuration follow the documented alphabet.
    #[test]
    fn tokens_cannot_carry_the_node_role_and_names_are_checked() {
        let token = |role: &str, name: &str| {
            format!(
                "[[auth.tokens]]\nrole = {role:?}\nname = {name:?}\nsha256 = \"{}\"\n",
                "0".repeat(64)
            )
        };
        let e = Config::from_toml(&token("node", "9")).unwrap().validate().unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("auth.tokens") && m.contains("role \"node\"") && m.contains("cannot carry"),
            "{m}"
        );
        let e = Config::from_toml(&token("application", ".."))
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("must start with a letter or a digit"), "{e}");
        Config::from_toml(&token("application", "shop"))
            .unwrap()
            .validate()
            .unwrap();
    }

    /// `auth.self_enlist`: names checked, every entry names applications, one
    /// entry per participant.
    #[test]
    fn self_enlist_entries_are_checked() {
        let e = Config::from_toml("[[auth.self_enlist]]\nparticipant = \"..\"\napplications = [\"shop\"]")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("auth.self_enlist"), "{e}");
        let e = Config::from_toml("[[auth.self_enlist]]\nparticipant = \"inventory\"\napplications = []")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("names no applications"), "{e}");
        Config::from_toml("[[auth.self_enlist]]\nparticipant = \"inventory\"\napplications = [\"shop\"]")
            .unwrap()
            .validate()
            .unwrap();
        let twice = "[[auth.self_enlist]]\nparticipant = \"inventory\"\napplications = [\"shop\"]\n";
        let e = Config::from_toml(&format!("{twice}{twice}"))
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("listed twice"), "{e}");
    }

    /// `participants.allowed_addresses`: absent or empty allows any address;
    /// entries are checked with a message that names the key and the entry.
    #[test]
    fn participant_address_policy_is_checked() {
        assert!(Config::from_toml("").unwrap().participants.allowed_addresses.is_empty());
        Config::from_toml(
            "[participants]\nallowed_addresses = [\"10.0.0.0/8\", \"127.0.0.0/8\", \"bank-*.svc.internal\"]",
        )
        .unwrap()
        .validate()
        .unwrap();
        let e = Config::from_toml("[participants]\nallowed_addresses = [\"10.0.0.1/8\"]")
            .unwrap()
            .validate()
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid configuration: participants.allowed_addresses: entry \"10.0.0.1/8\" has host bits set after /8; the network is 10.0.0.0/8"
        );
        assert_eq!(Config::from_toml("").unwrap().txn.never_answered_give_up_ms, 600_000);
    }

    #[test]
    fn bad_values_name_the_field() {
        let e = Config::from_toml("node_id = 0").unwrap().validate().unwrap_err();
        assert!(e.to_string().contains("node_id"), "{e}");
        let e = Config::from_toml("raft_addr = \"nope\"")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("raft_addr"), "{e}");
        let e = Config::from_toml("[batch]\nentries_max = 0")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("batch.entries_max"), "{e}");
        let e = Config::from_toml("cluster_id = \"a b\"")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("cluster_id"), "{e}");
        let e = Config::from_toml("[txn]\ndelivery_batch_wait_us = 100001")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("txn.delivery_batch_wait_us"), "{e}");
        let e = Config::from_toml("[batch]\nrefill_wait_us = 100001")
            .unwrap()
            .validate()
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid configuration: batch.refill_wait_us must be at most 100000 (100 ms), got 100001"
        );
        let e = Config::from_toml("[batch]\nrefill_callers_min = 1")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(
            e.to_string().contains("batch.refill_callers_min must be at least 2"),
            "{e}"
        );
    }

    #[test]
    fn the_commit_index_window_stays_within_an_election_timeout_after_a_heartbeat() {
        let c = Config::from_toml("").unwrap();
        assert_eq!(c.raft.commit_index_defer_max_ms, 50);
        assert_eq!(c.raft.commit_index_defer_window(), std::time::Duration::from_millis(50));
        let c = Config::from_toml("[raft]\nheartbeat_interval_ms = 100\nelection_timeout_min_ms = 150\nelection_timeout_max_ms = 300\nquorum_probe_interval_ms = 50")
            .unwrap();
        c.validate().unwrap();
        // 100 ms heartbeat + 25 ms window < 150 ms election timeout.
        assert_eq!(c.raft.commit_index_defer_window(), std::time::Duration::from_millis(25));
        let c = Config::from_toml("[raft]\ncommit_index_defer_max_ms = 0").unwrap();
        assert_eq!(c.raft.commit_index_defer_window(), std::time::Duration::ZERO);
        let c = Config::from_toml("[raft]\ncommit_index_defer_max_ms = 1000").unwrap();
        assert_eq!(
            c.raft.commit_index_defer_window(),
            std::time::Duration::from_millis(100)
        );
    }

    #[test]
    fn quorum_probe_interval_must_fit_before_the_first_election() {
        // Probe interval + probe timeout (twice the interval) must end
        // before a cut-off follower could campaign (docs/adr/0008).
        let e = Config::from_toml("[raft]\nquorum_probe_interval_ms = 101")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("raft.quorum_probe_interval_ms"), "{e}");
        for ok in ["0", "100"] {
            Config::from_toml(&format!("[raft]\nquorum_probe_interval_ms = {ok}"))
                .unwrap()
                .validate()
                .unwrap();
        }
        // Older config files without the key get the probe.
        assert_eq!(Config::from_toml("").unwrap().raft.quorum_probe_interval_ms, 100);
    }

    #[test]
    fn unknown_keys_are_refused() {
        let e = Config::from_toml("node_idd = 3").unwrap_err();
        assert!(e.to_string().contains("node_idd"), "{e}");
    }
}
