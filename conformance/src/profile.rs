//! What the kit is told: where the service listens and how to reach it
//! (`Target`), and what it needs to know of the service's business
//! (`Profile`).

use std::sync::Arc;
use std::time::Duration;

use crate::effect::Effect;

/// Where the participant under test listens and how to reach it.
#[derive(Clone)]
pub struct Target {
    /// Its `ParticipantService` address (host:port).
    pub address: String,
    /// The participant id it serves as (messages name it).
    pub participant_id: String,
    /// TLS settings when it serves TLS.
    pub tls: Option<Arc<dtx_tls::ClientTls>>,
    /// A bearer token (the node role) when it asks for one.
    pub token: Option<String>,
    /// How long one call may take before its outcome counts as unknown.
    pub call_timeout: Duration,
}

/// What the kit needs to know of the service's business.
#[derive(Clone)]
pub struct Profile {
    /// A payload the service votes YES on, and again after each decision
    /// (a deposit of 1, say).
    pub yes_payload: Vec<u8>,
    /// A payload it votes NO on (the rules that need one are skipped
    /// without it).
    pub no_payload: Option<Vec<u8>>,
    /// A payload it votes READ_ONLY on.
    pub read_only_payload: Option<Vec<u8>>,
    /// Reads the effect of committed YES payloads (the effect rules are
    /// skipped without it).
    pub effect: Option<Arc<dyn Effect>>,
    /// How much one commit of `yes_payload` changes what `effect` reads.
    pub effect_per_commit: i64,
}
