//! A node process whose Raft stopped on a fatal error always ends, within a
//! bound, with its error, so that a supervisor restarts it.
//!
//! The orderly way out (`node::run`'s steps, each with its timeout, then
//! the drops of the stores and the command's runtime shutdown) is not
//! enough on its own: after a storage failure a flush or fsync may never
//! return, and then a drop that waits for the store's writer thread, or
//! sled's own drop, waits for ever. That can happen on the runtime's one
//! thread before `node::run` has even seen the error (openraft's state
//! machine task drops its store as the core quits), and a hung runtime
//! thread also loses SIGTERM (tokio handles it there). Found on an ext4
//! filesystem whose backing store ran out, so ENOSPC came at fsync: the
//! node logged the fatal error and `final flush failed`, then every thread
//! waited on a futex until SIGKILL.
//!
//! So, in a process that [`enable`]s it (`coordinator serve`: one node per
//! process), a watchdog thread of its own, outside the runtime, watches
//! Raft's metrics. Once Raft reports a fatal error (`node::run` reports it
//! too, whichever sees it first, see [`fatal`]): the alert line is logged
//! once, SIGTERM and SIGINT end the process at once, and if the process
//! has not exited when the bound has passed, the watchdog writes the error
//! as the command would (`Error: ...`) straight to stderr and ends the
//! process with exit status 1, without running any more destructors or
//! waiting for any other thread. A requested stop (Raft's `Stopped`)
//! never arms it: normal shutdown is unchanged.

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::Duration;
use std::time::Instant;

use tracing::error;

use crate::raft::NodeId;
use crate::raft::NodeInfo;

/// The exit status of a node stopped on a fatal error (what `main`
/// returning an error gives).
pub const EXIT_CODE: i32 = 1;

/// How often the watchdog looks at Raft's state.
const POLL: Duration = Duration::from_millis(20);

/// Set by [`enable`]: this process is one node, and ends with it.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// Set once, by the first to see the fatal error.
static ARMED: OnceLock<Armed> = OnceLock::new();

struct Armed {
    /// When the process ends if it has not exited by then.
    deadline: Instant,
    bound: Duration,
    /// The command's last words: `Error: <error>\n`.
    words: String,
    /// What a SIGTERM or SIGINT after the error writes before the exit
    /// (read by the signal handler: prepared in advance).
    on_signal: Vec<u8>,
}

/// Makes a fatal error of a node in this process end the process within
/// the bound given to [`watch`]. Only for a process that runs one node and
/// nothing else (`coordinator serve`); without it a node's fatal error
/// only makes `node::run` return it.
pub fn enable() {
    ENABLED.store(true, Ordering::SeqCst);
}

/// Starts the watchdog of the node `node_id` whose Raft reports to
/// `metrics`: once Raft stops on a fatal error the process ends within
/// `bound` (nothing without [`enable`]). The thread ends by itself when
/// Raft stops without a fatal error.
pub fn watch(
    node_id: NodeId,
    mut metrics: tokio::sync::watch::Receiver<openraft::RaftMetrics<NodeId, NodeInfo>>,
    bound: Duration,
) {
    if !ENABLED.load(Ordering::SeqCst) {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("dtx-fatal-exit".into())
        .spawn(move || loop {
            if let Some(a) = ARMED.get() {
                let left = a.deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    exit_now(a);
                }
                std::thread::sleep(left.min(POLL));
                continue;
            }
            // Whether the sender is gone, before the last value is read: Raft
            // sends its final state and then drops the sender.
            let closed = metrics.has_changed().is_err();
            let stopped = match &metrics.borrow_and_update().running_state {
                Ok(()) => None,
                Err(openraft::error::Fatal::Stopped) => Some(None),
                Err(e) => Some(Some(e.to_string())),
            };
            match stopped {
                Some(Some(reason)) => fatal(node_id, &format!("raft stopped on a fatal error: {reason}"), bound),
                // A requested stop: the orderly way out, as always.
                Some(None) => return,
                None if closed => return,
                None => std::thread::sleep(POLL),
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(node_id, "the fatal-error watchdog did not start: {e}");
    }
}

/// Reports the node's fatal error `error` (the alert line, logged once
/// per process when enabled) and, when enabled, arms the exit: within
/// `bound` from the first report, and at once on SIGTERM or SIGINT.
/// Called by `node::run` when it sees the error and by the watchdog,
/// whichever comes first.
pub fn fatal(node_id: NodeId, error: &str, bound: Duration) {
    if !ENABLED.load(Ordering::SeqCst) {
        error!(target: "coordinator::node", node_id, "{error}");
        return;
    }
    let mut first = false;
    let armed = ARMED.get_or_init(|| {
        first = true;
        let words = format!("Error: {error}\n");
        Armed {
            deadline: Instant::now() + bound,
            bound,
            on_signal: format!(
                "coordinator: node {node_id}: signalled on its way out after a fatal error; exiting now\n{words}"
            )
            .into_bytes(),
            words,
        }
    });
    if first {
        // Before the alert line: a SIGTERM sent by whoever reads it finds
        // the handler in place.
        install_signal_exit();
        // The alert line as `node::run` always logged it.
        error!(target: "coordinator::node", node_id, "{error}");
        tracing::info!(
            node_id,
            "this process exits within {:?} of the fatal error, orderly or not (at once on SIGTERM)",
            armed.bound
        );
    }
}

/// Writes `bytes` to stderr with write(2): no lock another thread could
/// hold, safe in a signal handler.
fn write_stderr(bytes: &[u8]) {
    let mut rest = bytes;
    while !rest.is_empty() {
        // SAFETY: write(2) from a live buffer of `rest.len()` bytes.
        let n = unsafe { libc::write(libc::STDERR_FILENO, rest.as_ptr().cast(), rest.len()) };
        if n <= 0 {
            // EINTR: again; anything else: nothing more can be said.
            if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return;
        }
        rest = &rest[n as usize..];
    }
}

fn exit_now(a: &Armed) -> ! {
    write_stderr(
        format!(
            "coordinator: the way out after a fatal error did not finish within {:?}; exiting now\n",
            a.bound
        )
        .as_bytes(),
    );
    write_stderr(a.words.as_bytes());
    // SAFETY: _exit(2) ends the process without running destructors or
    // atexit handlers, any of which could wait for a stuck thread.
    unsafe { libc::_exit(EXIT_CODE) }
}

extern "C" fn on_signal(_: libc::c_int) {
    // Only async-signal-safe work: the words were prepared when the exit
    // was armed (this handler is installed only after that).
    if let Some(a) = ARMED.get() {
        write_stderr(&a.on_signal);
    }
    // SAFETY: _exit(2) is async-signal-safe.
    unsafe { libc::_exit(EXIT_CODE) }
}

/// SIGTERM and SIGINT end the process at once from now on (they replace
/// tokio's handlers, whose runtime may be the thread that is stuck).
fn install_signal_exit() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: sigaction(2) with a zeroed struct, an empty mask and a
        // handler that does only async-signal-safe work.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(sig, &action, std::ptr::null_mut()) != 0 {
                tracing::warn!(
                    "cannot install the exit on signal {sig}: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}
