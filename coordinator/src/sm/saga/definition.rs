//! Saga definitions: ordered steps, each COMPENSABLE, PIVOT or RETRIABLE, and
//! the rules a definition must keep to be registered. Pure: no I/O.
//!
//! The rules (a definition breaking one is refused with the reason):
//! - at least one step, at most `limits::SAGA_STEPS_MAX`;
//! - the kinds run COMPENSABLE* PIVOT? RETRIABLE*: at most one pivot, no
//!   RETRIABLE step before the pivot (it could not be undone if a later
//!   step before the pivot failed), and past the pivot only RETRIABLE
//!   steps (the saga only goes forward there); READ_ONLY steps (they
//!   change nothing) may stand anywhere among them;
//! - a COMPENSABLE step names its compensation; a PIVOT, RETRIABLE or
//!   READ_ONLY step names none (nothing would ever run it);
//! - every step names its service, its forward action and its status
//!   query (the query that turns an UNKNOWN outcome into a known one);
//! - the registered recovery options fit the kind: COMPENSATE only before
//!   and at the pivot, and a step's options are each named once;
//! - retry policy: at least one attempt, the initial backoff not above the
//!   maximum;
//! - only a COMPENSABLE step is high-impact (its compensation waits for an
//!   approval).

use serde::Deserialize;
use serde::Serialize;

use crate::limits;

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepKind {
    Compensable,
    Pivot,
    Retriable,
    /// Changes nothing: never compensated, never a point of no return
    /// (appended: the encoding of the others is unchanged).
    ReadOnly,
}

impl StepKind {
    pub fn name(self) -> &'static str {
        match self {
            StepKind::Compensable => "COMPENSABLE",
            StepKind::Pivot => "PIVOT",
            StepKind::Retriable => "RETRIABLE",
            StepKind::ReadOnly => "READ_ONLY",
        }
    }
}

/// What the orchestrator may do about a failed step: only these, and only
/// those the step's definition registered (the policy boundary).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Recovery {
    /// Run the forward action again (a new attempt).
    Retry,
    /// Compensate the completed steps, newest first.
    Compensate,
    /// Park for an operator.
    Park,
}

impl Recovery {
    pub fn name(self) -> &'static str {
        match self {
            Recovery::Retry => "RETRY",
            Recovery::Compensate => "COMPENSATE",
            Recovery::Park => "PARK",
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Calls per step (forward or compensation) before the limit is reached.
    pub max_attempts: u32,
    pub backoff_initial_ms: u64,
    pub backoff_max_ms: u64,
}

impl RetryPolicy {
    /// The wait before attempt `attempt + 1` after `attempt` calls:
    /// doubling from the initial backoff, capped at the maximum.
    pub fn backoff_ms(&self, attempt: u32) -> u64 {
        let shift = attempt.saturating_sub(1).min(32);
        self.backoff_initial_ms
            .saturating_mul(1u64 << shift)
            .min(self.backoff_max_ms.max(self.backoff_initial_ms))
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            backoff_initial_ms: 100,
            backoff_max_ms: 5_000,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct StepDef {
    pub name: String,
    pub kind: StepKind,
    /// The step service's address.
    pub service: String,
    pub action: String,
    /// Required for COMPENSABLE steps, None otherwise.
    pub compensation: Option<String>,
    pub status_query: String,
    /// The forward action reports the resource's version; the compensation
    /// carries it as its precondition.
    pub versioned: bool,
    pub retry: RetryPolicy,
    /// Registered recovery options, in the order the default policy tries
    /// them; empty means the kind's default (`StepDef::recovery`).
    pub on_failure: Vec<Recovery>,
    /// Its compensation is high-impact: it runs only after someone
    /// approved it (an operator's APPROVE, recorded with who and why).
    /// COMPENSABLE steps only.
    pub high_impact: bool,
    /// How long a forward call that answered PENDING may wait for its
    /// completion before the saga parks for an operator; 0: no limit (the
    /// saga's deadline, if any, still applies before the pivot).
    pub completion_timeout_ms: u64,
}

impl StepDef {
    /// The recovery options registered for this step: its own list, or the
    /// kind's default (COMPENSABLE and PIVOT: compensate; RETRIABLE and
    /// READ_ONLY: retry, then park).
    pub fn recovery(&self) -> Vec<Recovery> {
        if !self.on_failure.is_empty() {
            return self.on_failure.clone();
        }
        match self.kind {
            StepKind::Compensable | StepKind::Pivot => vec![Recovery::Compensate],
            StepKind::Retriable | StepKind::ReadOnly => vec![Recovery::Retry, Recovery::Park],
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Definition {
    pub name: String,
    pub version: u32,
    pub steps: Vec<StepDef>,
}

impl Definition {
    /// The pivot's index, if there is one.
    pub fn pivot(&self) -> Option<usize> {
        self.steps.iter().position(|s| s.kind == StepKind::Pivot)
    }

    /// "<name>@<version>".
    pub fn label(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }

    /// Checks every rule of the module's documentation; the error says
    /// which step broke which rule.
    pub fn validate(&self) -> Result<(), String> {
        check_name("definition name", &self.name)?;
        if self.version == 0 {
            return Err("version must be at least 1".into());
        }
        if self.steps.is_empty() {
            return Err("a saga needs at least one step".into());
        }
        if self.steps.len() > limits::SAGA_STEPS_MAX {
            return Err(format!(
                "{} steps; the limit is saga_steps_max = {}",
                self.steps.len(),
                limits::SAGA_STEPS_MAX
            ));
        }
        let mut names = std::collections::BTreeSet::new();
        let mut seen_pivot: Option<&str> = None;
        let mut seen_retriable: Option<&str> = None;
        for (i, s) in self.steps.iter().enumerate() {
            let at = format!("step {i} ({:?})", s.name);
            check_name(&format!("{at}: name"), &s.name)?;
            if !names.insert(s.name.as_str()) {
                return Err(format!("{at}: the name is used by an earlier step"));
            }
            check_name(&format!("{at}: service"), &s.service)?;
            if s.service.len() > limits::ADDRESS_BYTES_MAX {
                return Err(format!(
                    "{at}: service is longer than {} bytes",
                    limits::ADDRESS_BYTES_MAX
                ));
            }
            check_name(&format!("{at}: action"), &s.action)?;
            if s.status_query.is_empty() {
                return Err(format!(
                    "{at}: a status query is required: an UNKNOWN outcome is reconciled through it \
                     before any retry or compensation"
                ));
            }
            check_name(&format!("{at}: status query"), &s.status_query)?;
            match (s.kind, &s.compensation) {
                (StepKind::Compensable, None) => {
                    return Err(format!("{at}: a COMPENSABLE step must name its compensation"))
                }
                (StepKind::Compensable, Some(c)) => check_name(&format!("{at}: compensation"), c)?,
                (k, Some(_)) => {
                    return Err(format!(
                        "{at}: a {} step cannot have a compensation (it is never undone)",
                        k.name()
                    ))
                }
                (_, None) => {}
            }
            if s.high_impact && s.kind != StepKind::Compensable {
                return Err(format!(
                    "{at}: only a COMPENSABLE step can be high-impact (its compensation waits for an approval); a {} step has none",
                    s.kind.name()
                ));
            }
            match s.kind {
                StepKind::Compensable => {
                    if let Some(p) = seen_pivot {
                        return Err(format!(
                            "{at}: after the pivot {p:?} only RETRIABLE steps may follow (the saga only goes forward there)"
                        ));
                    }
                    if let Some(r) = seen_retriable {
                        return Err(format!(
                            "{at}: a COMPENSABLE step cannot follow the RETRIABLE step {r:?}"
                        ));
                    }
                }
                StepKind::Pivot => {
                    if let Some(p) = seen_pivot {
                        return Err(format!(
                            "{at}: a second pivot (the first is {p:?}); a saga has at most one"
                        ));
                    }
                    if let Some(r) = seen_retriable {
                        return Err(format!(
                            "{at}: the pivot cannot follow the RETRIABLE step {r:?}: a RETRIABLE step before the pivot could not be undone"
                        ));
                    }
                    seen_pivot = Some(&s.name);
                }
                StepKind::Retriable => {
                    seen_retriable.get_or_insert(&s.name);
                }
                // Reads nothing back and undoes nothing: anywhere.
                StepKind::ReadOnly => {}
            }
            if s.retry.max_attempts == 0 {
                return Err(format!("{at}: retry.max_attempts must be at least 1"));
            }
            if s.retry.backoff_initial_ms > s.retry.backoff_max_ms {
                return Err(format!(
                    "{at}: retry.backoff_initial_ms ({}) is above retry.backoff_max_ms ({})",
                    s.retry.backoff_initial_ms, s.retry.backoff_max_ms
                ));
            }
            let mut opts = std::collections::BTreeSet::new();
            for o in &s.on_failure {
                if !opts.insert(*o) {
                    return Err(format!("{at}: recovery option {} is named twice", o.name()));
                }
                if *o == Recovery::Compensate && s.kind == StepKind::Retriable {
                    return Err(format!(
                        "{at}: COMPENSATE is not a recovery option of a RETRIABLE step (it comes after the pivot, or after steps that cannot be undone)"
                    ));
                }
                if *o == Recovery::Compensate && s.kind == StepKind::ReadOnly {
                    if let Some(past) = seen_pivot.or(seen_retriable) {
                        return Err(format!(
                            "{at}: COMPENSATE is not a recovery option of a READ_ONLY step after {past:?} (the saga only goes forward there)"
                        ));
                    }
                }
            }
        }
        // A RETRIABLE step with no pivot before it is only allowed after
        // every COMPENSABLE step (checked above), so the last COMPENSABLE
        // step acts as the pivot.
        Ok(())
    }
}

fn check_name(field: &str, v: &str) -> Result<(), String> {
    if v.is_empty() {
        return Err(format!("{field} must not be empty"));
    }
    if v.len() > limits::ID_BYTES_MAX {
        return Err(format!(
            "{field} is {} bytes; the limit is {} bytes",
            v.len(),
            limits::ID_BYTES_MAX
        ));
    }
    if v.chars().any(|c| c.is_control()) {
        return Err(format!("{field} must not contain control characters"));
    }
    Ok(())
}
