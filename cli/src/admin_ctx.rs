//! What every `admin` subcommand shares: the connection settings
//! (`Ctx`), how a command ends (`Failure`, with the exit code its error
//! maps to), and printing a result as a table or JSON (`emit`).

use std::time::Duration;

use dtx_client::Client;
#[cfg(test)]
use dtx_client::ClientConfig;
use dtx_client::ClientError;

use crate::exit_codes::EXIT_ERROR;
use crate::exit_codes::EXIT_REFUSED;
use crate::exit_codes::EXIT_UNKNOWN;
use crate::exit_codes::EXIT_UNREACHABLE;

/// How a command ended: the exit code and the line for stderr.
pub(crate) struct Failure {
    pub(crate) code: i32,
    pub(crate) message: String,
}

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Failure {
        let code = match &e {
            ClientError::InvalidArgument(_)
            | ClientError::NotFound(_)
            | ClientError::AlreadyExists(_)
            | ClientError::FailedPrecondition(_)
            | ClientError::BranchRefused { .. }
            | ClientError::Unimplemented(_)
            | ClientError::Unauthenticated(_)
            | ClientError::PermissionDenied(_)
            | ClientError::NotApplied(_) => EXIT_REFUSED,
            ClientError::Unknown(_) => EXIT_UNKNOWN,
            ClientError::Unavailable(_) => EXIT_UNREACHABLE,
            ClientError::Internal(_) => EXIT_ERROR,
        };
        Failure {
            code,
            message: e.to_string(),
        }
    }
}

impl From<tonic::Status> for Failure {
    fn from(s: tonic::Status) -> Failure {
        use tonic::Code;
        let code = match s.code() {
            // Nothing was sent (not connected): that node was not reached.
            _ if dtx_transport::unary::nothing_sent(&s) => EXIT_UNREACHABLE,
            // The node said the call was certainly not applied: a refusal
            // (nothing changed), whatever the code.
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown | Code::ResourceExhausted
                if dtx_proto::metadata::not_applied(&s) =>
            {
                EXIT_REFUSED
            }
            Code::InvalidArgument
            | Code::NotFound
            | Code::AlreadyExists
            | Code::FailedPrecondition
            | Code::Unimplemented
            | Code::Unauthenticated
            | Code::PermissionDenied
            | Code::OutOfRange => EXIT_REFUSED,
            Code::Unavailable => EXIT_UNREACHABLE,
            Code::DeadlineExceeded | Code::Cancelled | Code::Unknown => EXIT_UNKNOWN,
            _ => EXIT_ERROR,
        };
        Failure {
            code,
            message: format!("{:?}: {}", s.code(), dtx_client::describe(&s)),
        }
    }
}

pub(crate) fn failure(code: i32, message: impl Into<String>) -> Failure {
    Failure {
        code,
        message: message.into(),
    }
}

pub(crate) fn local(e: impl std::fmt::Display) -> Failure {
    failure(EXIT_ERROR, e.to_string())
}

pub(crate) type Outcome = Result<(), Failure>;

/// What a command runs with: the addresses, the output format, the
/// timeout, the client and the TLS settings and token.
pub(crate) struct Ctx {
    pub(crate) addrs: Vec<String>,
    pub(crate) json: bool,
    pub(crate) timeout: Duration,
    pub(crate) client: Client,
    pub(crate) tls: Option<std::sync::Arc<dtx_tls::ClientTls>>,
    pub(crate) token: Option<String>,
}

#[cfg(test)]
impl Ctx {
    /// A plain-text context without a token, for the subcommands' tests.
    pub(crate) fn for_tests(addrs: Vec<String>, json: bool, timeout: Duration) -> Ctx {
        Ctx {
            client: Client::new(ClientConfig::new(addrs.clone())).expect("client"),
            addrs,
            json,
            timeout,
            tls: None,
            token: None,
        }
    }
}

/// Prints `value` with --json, else `text()`.
pub(crate) fn emit(ctx: &Ctx, value: serde_json::Value, text: impl FnOnce() -> String) {
    if ctx.json {
        outln!("{}", serde_json::to_string_pretty(&value).expect("JSON"));
    } else {
        outln!("{}", text());
    }
}

/// Writes one line of command output to stdout (the `outln!` macro). A
/// closed pipe (the reader, `head` say, had enough) ends the process with
/// exit 0 and nothing on stderr; another write error ends it with exit 1
/// and one line saying so.
pub(crate) fn write_out(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let written = out
        .write_fmt(args)
        .and_then(|_| out.write_all(b"\n"))
        .and_then(|_| out.flush());
    match written {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            eprintln!("error: cannot write the output: {e}");
            std::process::exit(1);
        }
    }
}

/// A transaction list reads at most this many pages when asked for
/// everything.
const LIST_PAGES_MAX: usize = 1000;

/// Every page of `req` (at most `LIST_PAGES_MAX`), and the leader's clock
/// of the last answer.
pub(crate) async fn list_all(
    ctx: &Ctx,
    mut req: dtx_proto::v1::ListTransactionsRequest,
) -> Result<(Vec<dtx_proto::v1::StatusResponse>, u64), Failure> {
    let mut out = Vec::new();
    let mut now = 0;
    for _ in 0..LIST_PAGES_MAX {
        let page = ctx.client.list_transactions(req.clone()).await?;
        now = page.now_unix_ms;
        out.extend(page.transactions);
        if page.next_after_txid == 0 {
            return Ok((out, now));
        }
        req.after_txid = page.next_after_txid;
    }
    Ok((out, now))
}
