//! The participant conformance kit (docs/conformance.md): drives a running
//! `dtx.v1.ParticipantService`, written in any language, through the rules
//! of docs/protocol.md one by one, and reports each rule passed, failed
//! (with every message sent and received), skipped (the participant does
//! not serve an optional call, or the profile gives no payload for it) or
//! unknown (a call got no answer in time: the kit never counts a timeout as
//! a verdict).
//!
//! The kit speaks only the wire contract (no SDK code), in an incarnation
//! of its own chosen at random per rule, so it touches no transaction of a
//! real cluster and the rules do not see each other's records. What it
//! needs to know of the service's business is in a `Profile`: a payload it
//! votes YES on (and that is valid again after each decision), optionally
//! one it votes NO on and one it votes READ_ONLY on, and optionally a probe
//! that reads a number the YES payload's commit changes by a known amount,
//! for the rules that count applied effects (exactly once).
//!
//! ```text
//! coordinator conformance participant --address 127.0.0.1:7301 \
//!     --participant-id bank-a --yes-payload a0:1 --no-payload nosuch:1 \
//!     --effect-command 'dtx-dev bank-balance --app 127.0.0.1:7311 --account a0'
//! ```

mod crash;
mod ctx;
pub mod effect;
mod profile;
pub mod report;
mod rules;
pub mod service;
pub mod steps;
pub mod wire;

use std::sync::Arc;

pub use effect::CommandEffect;
pub use effect::Effect;
pub use profile::Profile;
pub use profile::Target;
pub use report::Report;
pub use report::RuleReport;
pub use report::Verdict;
pub use rules::RULES;
pub use service::CommandService;
pub use service::Service;
pub use steps::run_steps;
pub use steps::StepProfile;
pub use steps::STEP_RULES;

/// Runs every rule (or those whose id starts with one of `only`, when
/// given) against `target`, one after another. With `service` (the kit
/// started it: `--start`) the `crash.` rules kill it with SIGKILL and
/// start it again; without, they are skipped.
pub async fn run(target: &Target, profile: &Profile, only: &[String], service: Option<Arc<dyn Service>>) -> Report {
    let mut rules = Vec::new();
    for rule in RULES {
        if !only.is_empty() && !only.iter().any(|o| rule.id.starts_with(o.as_str())) {
            continue;
        }
        rules.push(rules::run_one(rule, target, profile, service.clone()).await);
    }
    Report {
        address: target.address.clone(),
        participant_id: target.participant_id.clone(),
        rules,
    }
}
