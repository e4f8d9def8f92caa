//! `coordinator conformance participant`: the participant conformance kit
//! (crate dtx-conformance, docs/conformance.md) against a running
//! participant service in any language. A report per rule, as text or
//! JSON; the exit status is 0 when every rule passed or was skipped, 1
//! when one failed, 4 when none failed but a call went unanswered
//! (unknown), 2 for a wrong command line.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

/// `conformance`'s subcommands.
#[derive(clap::Subcommand)]
pub enum ConformanceCmd {
    /// Drive a ParticipantService through the rules of docs/protocol.md.
    /// It changes the service's data: run it against a test instance. Its
    /// transactions are in incarnations of its own (one per rule), so no
    /// cluster's transaction is touched.
    Participant(ParticipantArgs),
    /// Drive a saga step service (SagaStepService) through the step rules
    /// of docs/sagas.md. It changes the service's data: run it against a
    /// test instance; each rule uses a saga id of its own.
    StepService(StepServiceArgs),
}

/// What every kind of run takes.
#[derive(clap::Args)]
struct Common {
    /// The service's address (host:port).
    #[arg(long)]
    address: String,
    /// Run only the rules whose id starts with one of these
    /// (comma-separated).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Print the report as one JSON document.
    #[arg(long)]
    json: bool,
    /// How long one call may take before its outcome counts as unknown.
    #[arg(long, default_value_t = 5_000)]
    call_timeout_ms: u64,
    /// Start the service with this shell command (it must listen on
    /// --address, on data that survives it), and run the crash rules too:
    /// kill -9 after an answer, during a call and during recovery, then
    /// start it again on the same data. The kit kills it when it ends.
    #[arg(long, value_name = "COMMAND")]
    start: Option<String>,
    /// How long a start may take to listen, in seconds.
    #[arg(long, default_value_t = 30)]
    start_timeout_s: u64,
    /// Where the started service's output goes (appended); by default a
    /// file in the temporary directory, named in the report.
    #[arg(long)]
    start_log: Option<std::path::PathBuf>,
    /// TLS and token settings (a node's certificate or token: the kit
    /// speaks as the coordinator does).
    #[command(flatten)]
    tls: dtx_tls::args::TlsArgs,
}

#[derive(clap::Args)]
pub struct StepServiceArgs {
    #[command(flatten)]
    common: Common,
    /// The step's forward action (the inventory's `reserve`).
    #[arg(long)]
    forward_action: String,
    /// Its compensation (`release`); none for a PIVOT or RETRIABLE step
    /// (the rules that compensate are skipped).
    #[arg(long)]
    compensate_action: Option<String>,
    /// Its status query (`reservation`).
    #[arg(long)]
    status_query: String,
    /// An input the forward action answers OK on, again for each new
    /// operation; `{saga}` in it becomes the rule's saga id (so an order
    /// id of its own: `{"order":"kit-{saga}","sku":"sku-0","qty":1,...}`).
    #[arg(long)]
    input: String,
    /// An input it answers FAILED on (the FAILED rules are skipped
    /// without it); `{saga}` as in --input.
    #[arg(long)]
    failed_input: Option<String>,
    /// The compensation checks its precondition against the resource
    /// version the forward action reported (answers STALE otherwise).
    #[arg(long)]
    versioned: bool,
}

#[derive(clap::Args)]
pub struct ParticipantArgs {
    #[command(flatten)]
    common: Common,
    /// The participant id it serves as.
    #[arg(long)]
    participant_id: String,
    /// A payload it votes YES on, again after each decision (for example
    /// the bank's `a0:1`, a deposit of 1). Text; `hex:` for bytes.
    #[arg(long, value_parser = parse_payload)]
    yes_payload: Payload,
    /// A payload it votes NO on (the NO rules are skipped without it).
    #[arg(long, value_parser = parse_payload)]
    no_payload: Option<Payload>,
    /// A payload it votes READ_ONLY on (the READ_ONLY rules are skipped
    /// without it).
    #[arg(long, value_parser = parse_payload)]
    read_only_payload: Option<Payload>,
    /// A shell command printing, as the last line of its output, a number
    /// each commit of the YES payload changes by --effect-per-commit (a
    /// balance): the exactly-once rules read it (skipped without it).
    #[arg(long)]
    effect_command: Option<String>,
    /// How much one commit of the YES payload changes the effect.
    #[arg(long, default_value_t = 1, allow_hyphen_values = true)]
    effect_per_commit: i64,
}

/// A payload's bytes.
#[derive(Clone, Debug, PartialEq)]
struct Payload(Vec<u8>);

/// A payload as given on the command line: text, or `hex:` and hex digits.
fn parse_payload(s: &str) -> Result<Payload, String> {
    let Some(hex) = s.strip_prefix("hex:") else {
        return Ok(Payload(s.as_bytes().to_vec()));
    };
    if hex.len() % 2 != 0 {
        return Err(format!("{s:?}: an odd number of hex digits"));
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).map_err(|e| format!("{s:?} is not hex: {e}")))
        .collect::<Result<Vec<u8>, String>>()
        .map(Payload)
}

/// Runs the command; the process exit status.
pub async fn run(cmd: ConformanceCmd) -> i32 {
    let done = match cmd {
        ConformanceCmd::Participant(a) => participant(a).await,
        ConformanceCmd::StepService(a) => step_service(a).await,
    };
    match done {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            crate::exit_codes::EXIT_USAGE
        }
    }
}

impl Common {
    /// The target, after checking that `--only` names rules of `ids`.
    fn target(&self, participant_id: &str, ids: &[&str]) -> anyhow::Result<dtx_conformance::Target> {
        let unknown: Vec<&String> = self
            .only
            .iter()
            .filter(|o| !ids.iter().any(|id| id.starts_with(o.as_str())))
            .collect();
        anyhow::ensure!(
            unknown.is_empty(),
            "--only {unknown:?} names no rule; the rules: {}",
            ids.join(", ")
        );
        Ok(dtx_conformance::Target {
            address: self.address.clone(),
            participant_id: participant_id.to_string(),
            tls: self.tls.client().context("TLS settings")?,
            token: self.tls.token().context("token")?,
            call_timeout: Duration::from_millis(self.call_timeout_ms),
        })
    }

    /// With `--start`, the service started (`Some(Some(..))`); without,
    /// `Some(None)`; `None` when it did not start (said on stderr).
    async fn service(&self, target: &dtx_conformance::Target) -> Option<Option<Arc<dyn dtx_conformance::Service>>> {
        let Some(command) = &self.start else {
            return Some(None);
        };
        let log = self
            .start_log
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join(format!("dtx-conformance-{}.log", std::process::id())));
        let s = Arc::new(dtx_conformance::CommandService::new(
            command.clone(),
            target.address.clone(),
            log.clone(),
            Duration::from_secs(self.start_timeout_s),
        ));
        if let Err(e) = dtx_conformance::Service::start(s.as_ref()).await {
            eprintln!("error: --start: {e}");
            return None;
        }
        eprintln!("started the service; its output: {}", log.display());
        Some(Some(s))
    }

    /// Prints `report`; its exit status.
    fn print(&self, report: &dtx_conformance::Report) -> anyhow::Result<i32> {
        if self.json {
            println!("{}", serde_json::to_string_pretty(&report.to_json())?);
        } else {
            print!("{}", report.to_text());
        }
        Ok(report.exit_status())
    }
}

async fn participant(a: ParticipantArgs) -> anyhow::Result<i32> {
    let ids: Vec<&str> = dtx_conformance::RULES.iter().map(|r| r.id).collect();
    let target = a.common.target(&a.participant_id, &ids)?;
    let effect = a.effect_command.map(|command| {
        Arc::new(dtx_conformance::CommandEffect {
            command,
            timeout: Duration::from_secs(30),
        }) as Arc<dyn dtx_conformance::Effect>
    });
    let profile = dtx_conformance::Profile {
        yes_payload: a.yes_payload.0,
        no_payload: a.no_payload.map(|p| p.0),
        read_only_payload: a.read_only_payload.map(|p| p.0),
        effect,
        effect_per_commit: a.effect_per_commit,
    };
    let Some(service) = a.common.service(&target).await else {
        return Ok(crate::exit_codes::EXIT_ERROR);
    };
    let report = dtx_conformance::run(&target, &profile, &a.common.only, service).await;
    a.common.print(&report)
}

async fn step_service(a: StepServiceArgs) -> anyhow::Result<i32> {
    let ids: Vec<&str> = dtx_conformance::STEP_RULES.iter().map(|r| r.id).collect();
    let target = a.common.target("", &ids)?;
    let profile = dtx_conformance::StepProfile {
        forward_action: a.forward_action,
        compensate_action: a.compensate_action,
        status_query: a.status_query,
        input: a.input,
        failed_input: a.failed_input,
        versioned: a.versioned,
    };
    let Some(service) = a.common.service(&target).await else {
        return Ok(crate::exit_codes::EXIT_ERROR);
    };
    let report = dtx_conformance::run_steps(&target, &profile, &a.common.only, service).await;
    a.common.print(&report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(subcommand)]
        cmd: ConformanceCmd,
    }

    #[test]
    fn payloads_are_text_or_hex_and_bad_hex_says_why() {
        assert_eq!(parse_payload("a0:1"), Ok(Payload(b"a0:1".to_vec())));
        assert_eq!(parse_payload("hex:00ff"), Ok(Payload(vec![0, 255])));
        assert!(parse_payload("hex:0").unwrap_err().contains("odd number"));
        assert!(parse_payload("hex:zz").unwrap_err().contains("is not hex"));
        let cli = Cli::try_parse_from([
            "kit",
            "participant",
            "--address",
            "127.0.0.1:1",
            "--participant-id",
            "p",
            "--yes-payload",
            "hex:01",
            "--no-payload",
            "no",
            "--only",
            "fence.,effect.",
        ])
        .unwrap();
        let ConformanceCmd::Participant(a) = cli.cmd else {
            panic!("not the participant command")
        };
        assert_eq!(a.yes_payload, Payload(vec![1]));
        assert_eq!(a.no_payload, Some(Payload(b"no".to_vec())));
        assert_eq!(a.common.only, vec!["fence.", "effect."]);
    }
}
