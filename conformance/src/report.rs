//! The kit's report: one entry per rule, as text for people and JSON for
//! programs, and the exit status for CI.

use serde::Serialize;

/// What became of one rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Every answer was what the rule asks.
    Passed,
    /// An answer broke the rule (`detail` says which, the transcript shows
    /// every message).
    Failed,
    /// Not tried: an optional call the participant does not serve
    /// (UNIMPLEMENTED), or a payload the profile does not give.
    Skipped,
    /// A call got no answer in time (or the connection failed): whether
    /// the participant keeps the rule is not known.
    Unknown,
}

/// One rule's outcome.
#[derive(Clone, Debug, Serialize)]
pub struct RuleReport {
    /// The rule's id (`prepare.repeat`, ...).
    pub id: &'static str,
    /// What the rule asks, in one sentence.
    pub title: &'static str,
    /// Where the docs state it (`protocol.md: Fencing`, ...).
    pub section: &'static str,
    pub verdict: Verdict,
    /// Why it failed, was skipped or is unknown (empty when passed).
    pub detail: String,
    /// Every message sent and what came back, in order.
    pub transcript: Vec<String>,
    /// Where the rule's records are, to find them in the service's log:
    /// the kit's incarnation for a participant rule (hex), the saga id for
    /// a step-service rule.
    pub scope: String,
}

/// The whole run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub address: String,
    pub participant_id: String,
    pub rules: Vec<RuleReport>,
}

/// Exit status: every rule passed or was skipped.
pub const EXIT_CONFORMS: i32 = 0;
/// At least one rule failed.
pub const EXIT_FAILED: i32 = 1;
/// None failed, but at least one is unknown (a call went unanswered).
pub const EXIT_UNKNOWN: i32 = 4;

impl Report {
    /// How many rules got `v`.
    pub fn count(&self, v: Verdict) -> usize {
        self.rules.iter().filter(|r| r.verdict == v).count()
    }

    /// The rule `id`'s entry.
    pub fn rule(&self, id: &str) -> Option<&RuleReport> {
        self.rules.iter().find(|r| r.id == id)
    }

    /// The process exit status the report calls for.
    pub fn exit_status(&self) -> i32 {
        if self.count(Verdict::Failed) > 0 {
            EXIT_FAILED
        } else if self.count(Verdict::Unknown) > 0 {
            EXIT_UNKNOWN
        } else {
            EXIT_CONFORMS
        }
    }

    /// The report as one JSON document (with counts).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "address": self.address,
            "participant_id": self.participant_id,
            "passed": self.count(Verdict::Passed),
            "failed": self.count(Verdict::Failed),
            "skipped": self.count(Verdict::Skipped),
            "unknown": self.count(Verdict::Unknown),
            "rules": self.rules,
        })
    }

    /// The report as text: one line per rule, and for every rule that did
    /// not pass, why and its transcript.
    pub fn to_text(&self) -> String {
        let who = if self.participant_id.is_empty() {
            "step service".to_string()
        } else {
            format!("participant {:?}", self.participant_id)
        };
        let mut out = format!(
            "{who} at {}: {} passed, {} failed, {} skipped, {} unknown\n",
            self.address,
            self.count(Verdict::Passed),
            self.count(Verdict::Failed),
            self.count(Verdict::Skipped),
            self.count(Verdict::Unknown)
        );
        for r in &self.rules {
            let mark = match r.verdict {
                Verdict::Passed => "pass",
                Verdict::Failed => "FAIL",
                Verdict::Skipped => "skip",
                Verdict::Unknown => "UNKNOWN",
            };
            out.push_str(&format!("{mark:<8}{:<32}{}\n", r.id, r.title));
            if r.verdict == Verdict::Passed {
                continue;
            }
            out.push_str(&format!("        {}\n", r.detail));
            if r.verdict == Verdict::Skipped {
                continue;
            }
            out.push_str(&format!("        ({}; {})\n", r.section, r.scope));
            for line in &r.transcript {
                out.push_str(&format!("          {line}\n"));
            }
        }
        out
    }
}
