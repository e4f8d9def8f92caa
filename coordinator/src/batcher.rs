//! Group commit. openraft 0.9 appends (and fsyncs) per Raft entry and does
//! not batch client writes, so concurrent commands reaching the leader are
//! grouped here into one `Batch` entry.
//!
//! Policy: a batch leaves as soon as an in-flight slot is free
//! (`inflight_max` entries may be in flight at once); while every slot is
//! busy, commands queue up and leave together. A batch holds at most
//! `entries_max` commands and `bytes_max` encoded bytes; after taking a slot
//! the batcher waits at most `wait_us` for more commands (0 = never wait).
//!
//! Refill under load (`refill_wait_us`, off by default; `refill_callers_min`):
//! when one of the last `REFILL_WINDOW_BATCHES` batches held N ≥
//! `refill_callers_min` callers (a caller is one `propose_together`, so the
//! node's own groups of acks or expiries count once), a batch waits at most
//! `refill_wait_us` for each next caller, and `REFILL_WAITS_MAX` times that
//! in all, until it holds N callers.
//! Callers that wait for their answer before they send again (a pool of
//! workers, a closed loop) all come back within a moment of the last
//! entry's answers; without the wait the first of them would leave alone
//! and the rest would wait a whole Raft round for the next entry, so
//! batches alternate small and large and every entry costs its round on all
//! three nodes. Like PostgreSQL's `commit_delay` with `commit_siblings`, a
//! lightly loaded leader (batches of fewer than `refill_callers_min`
//! callers) never waits. The waits lengthen a spread-out workload's Raft
//! writes (two-participant transfers at 64 clients lost 7-10 % of their
//! rate in the bench), hence off by default (docs/adr/0027).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use openraft::error::ClientWriteError;
use openraft::error::RaftError;
use tokio::sync::mpsc;
use tokio::sync::oneshot;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::codec;
use crate::raft::Batch;
use crate::raft::NodeId;
use crate::raft::NodeInfo;
use crate::raft::Raft;
use crate::sm::Command;
use crate::sm::CommandResult;

#[derive(Clone, Debug)]
pub struct BatchSettings {
    pub entries_max: usize,
    pub bytes_max: usize,
    pub wait_us: u64,
    pub inflight_max: usize,
    pub queue_max: usize,
    pub refill_wait_us: u64,
    pub refill_callers_min: usize,
}

/// The batches whose largest sets how many callers a batch waits for
/// under load (`refill_target`).
const REFILL_WINDOW_BATCHES: usize = 8;

/// A batch waits at most `refill_wait_us` for each next caller, and this
/// many times `refill_wait_us` in all.
const REFILL_WAITS_MAX: u64 = 4;

/// How many callers a batch waits for (at most `refill_wait_us` for each
/// next one), given the callers of the last batches: the most of them when it reaches
/// `callers_min`, capped at `entries_max`; 0 (no wait) otherwise.
fn refill_target(recent_callers: &VecDeque<usize>, callers_min: usize, entries_max: usize) -> usize {
    match recent_callers.iter().copied().max() {
        Some(n) if n >= callers_min => n.min(entries_max),
        _ => 0,
    }
}

/// Why a command was not applied. In every case the command may be retried:
/// all our commands are idempotent or write-once.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProposeError {
    #[error("this node is not the leader (leader: {leader_id:?})")]
    NotLeader {
        leader_id: Option<NodeId>,
        leader: Option<NodeInfo>,
    },
    #[error("raft is unavailable: {0}")]
    Unavailable(String),
    #[error("the proposal queue is full ({0} commands); retry later")]
    Overloaded(usize),
    #[error("command of {size} bytes is larger than batch.bytes_max {max}")]
    TooLarge { size: usize, max: usize },
}

/// One caller's commands: they go into the same Raft entry, in order.
struct Pending {
    cmds: Vec<Command>,
    size: usize,
    reply: oneshot::Sender<Result<Vec<CommandResult>, ProposeError>>,
}

#[derive(Clone)]
pub struct Batcher {
    tx: mpsc::Sender<Pending>,
    settings: BatchSettings,
}

impl Batcher {
    pub fn start(raft: Raft, settings: BatchSettings) -> Batcher {
        let (tx, rx) = mpsc::channel(settings.queue_max.max(1));
        tokio::spawn(run(raft, settings.clone(), rx));
        Batcher { tx, settings }
    }

    /// Proposes `cmds` in one Raft entry (with whatever else is waiting) and
    /// waits until they are applied; one result per command, in order. The
    /// caller keeps them within `entries_max` commands and `bytes_max` bytes.
    pub async fn propose_together(&self, cmds: Vec<Command>) -> Result<Vec<CommandResult>, ProposeError> {
        let size = cmds
            .iter()
            .map(|c| codec::encoded_len(c).unwrap_or(usize::MAX))
            .fold(0usize, usize::saturating_add);
        if size > self.settings.bytes_max {
            return Err(ProposeError::TooLarge {
                size,
                max: self.settings.bytes_max,
            });
        }
        if cmds.is_empty() {
            return Ok(Vec::new());
        }
        let (reply, rx) = oneshot::channel();
        self.tx.try_send(Pending { cmds, size, reply }).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => ProposeError::Overloaded(self.settings.queue_max),
            mpsc::error::TrySendError::Closed(_) => ProposeError::Unavailable("batcher stopped".into()),
        })?;
        rx.await
            .unwrap_or_else(|_| Err(ProposeError::Unavailable("raft stopped before answering".into())))
    }
}

async fn run(raft: Raft, s: BatchSettings, mut rx: mpsc::Receiver<Pending>) {
    let slots = Arc::new(Semaphore::new(s.inflight_max.max(1)));
    // A command that did not fit the previous batch opens the next one.
    let mut carry: Option<Pending> = None;
    let mut recent_callers: VecDeque<usize> = VecDeque::with_capacity(REFILL_WINDOW_BATCHES + 1);
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let first = match carry.take() {
            Some(p) => p,
            None => match rx.recv().await {
                Some(p) => p,
                None => return,
            },
        };
        let mut bytes = first.size;
        let mut count = first.cmds.len();
        let mut batch = vec![first];
        let slot_taken = Instant::now();
        let wait_until = slot_taken + Duration::from_micros(s.wait_us);
        let refill_until = slot_taken + Duration::from_micros(s.refill_wait_us.saturating_mul(REFILL_WAITS_MAX));
        let refill_to = if s.refill_wait_us == 0 {
            0
        } else {
            refill_target(&recent_callers, s.refill_callers_min, s.entries_max)
        };
        while count < s.entries_max {
            let next = match rx.try_recv() {
                Ok(p) => p,
                Err(_) if batch.len() < refill_to => match tokio::time::timeout_at(
                    refill_until.min(Instant::now() + Duration::from_micros(s.refill_wait_us)),
                    rx.recv(),
                )
                .await
                {
                    Ok(Some(p)) => p,
                    _ => break,
                },
                Err(_) if s.wait_us == 0 => break,
                Err(_) => match tokio::time::timeout_at(wait_until, rx.recv()).await {
                    Ok(Some(p)) => p,
                    _ => break,
                },
            };
            if bytes + next.size > s.bytes_max || count + next.cmds.len() > s.entries_max {
                carry = Some(next);
                break;
            }
            bytes += next.size;
            count += next.cmds.len();
            batch.push(next);
        }
        recent_callers.push_back(batch.len());
        if recent_callers.len() > REFILL_WINDOW_BATCHES {
            recent_callers.pop_front();
        }
        metrics::histogram!("dtx_batch_commands").record(count as f64);
        let raft = raft.clone();
        tokio::spawn(async move {
            write(raft, batch).await;
            drop(permit);
        });
    }
}

async fn write(raft: Raft, batch: Vec<Pending>) {
    let mut commands = Vec::new();
    let mut replies = Vec::with_capacity(batch.len());
    for p in batch {
        replies.push((p.cmds.len(), p.reply));
        commands.extend(p.cmds);
    }
    match raft.client_write(Batch { commands }).await {
        Ok(resp) => {
            let mut results = resp.data.results.into_iter();
            for (n, r) in replies {
                let mine: Vec<CommandResult> = results.by_ref().take(n).collect();
                let res = if mine.len() == n {
                    Ok(mine)
                } else {
                    Err(ProposeError::Unavailable(
                        "state machine returned too few results".into(),
                    ))
                };
                let _ = r.send(res);
            }
        }
        Err(e) => {
            let err = match e {
                RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => ProposeError::NotLeader {
                    leader_id: f.leader_id,
                    leader: f.leader_node,
                },
                RaftError::APIError(other) => ProposeError::Unavailable(other.to_string()),
                RaftError::Fatal(f) => ProposeError::Unavailable(f.to_string()),
            };
            for (_, r) in replies {
                let _ = r.send(Err(err.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_waits_for_the_largest_recent_batch_only_under_load() {
        let counts = |v: &[usize]| v.iter().copied().collect::<VecDeque<usize>>();
        // Nothing yet, or only small batches: never wait.
        assert_eq!(refill_target(&counts(&[]), 16, 512), 0);
        assert_eq!(refill_target(&counts(&[1, 1, 3, 15]), 16, 512), 0);
        // A fragment after a full batch waits for the full one again.
        assert_eq!(refill_target(&counts(&[64, 5]), 16, 512), 64);
        assert_eq!(refill_target(&counts(&[16]), 16, 512), 16);
        // Never beyond what one entry may hold.
        assert_eq!(refill_target(&counts(&[900, 2]), 16, 512), 512);
    }
}
