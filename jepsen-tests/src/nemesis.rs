//! The faults (nemeses) and their schedule. Every fault acts at the
//! operating-system or network level (signals, nftables, libfaketime,
//! crash points armed from outside, a filesystem filled up); none asks a
//! node to cooperate.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// One kind of fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fault {
    /// kill -9 the current leader; restart it at the end of the fault.
    KillLeader,
    /// kill -9 a random coordinator node; restart it.
    KillNode,
    /// kill -9 every coordinator node at once; restart them at the end of
    /// the fault, the old leader first (openraft 0.9 then resumes its
    /// leadership in the same term, without an election: ADR 0023).
    KillAllNodes,
    /// kill -9 a random bank participant service; restart it.
    KillParticipant,
    /// SIGSTOP the leader past the election timeout, then SIGCONT: a stale
    /// leader wakes up.
    PauseLeader,
    /// One random node cut off from the other nodes.
    PartitionIsolate,
    /// A minority (one node and one bank) cut off from the majority (the
    /// other nodes and banks).
    PartitionMajority,
    /// A bridge: two nodes cannot talk to each other, the third talks to both.
    PartitionBridge,
    /// The leader cut off from every participant, not from its followers.
    PartitionLeaderParticipants,
    /// The leader cut off from its followers, not from the participants.
    PartitionLeaderFollowers,
    /// A random node restarted with its wall clock skewed (libfaketime).
    ClockSkew,
    /// A crash point of the `failpoints` build armed for one process.
    CrashPoint,
    /// Messages from the coordinator to participants delayed, duplicated
    /// and replayed late, by the proxies in front of the banks (`msgproxy`).
    MessageChaos,
    /// A bank participant killed (-9) and never restarted; its address
    /// stops answering. Once per run: later turns are skipped.
    ParticipantGone,
    /// The small filesystem (tmpfs) holding one node's and one bank's data
    /// directories filled until ENOSPC, then freed; processes that exited
    /// are restarted after space is freed.
    DiskFull,
    /// The PostgreSQL server of the PostgreSQL workload killed (-9, the
    /// postmaster and every backend); restarted (crash recovery) at the end
    /// of the fault. Only in that workload.
    KillPostgres,
    /// The PostgreSQL server of the PostgreSQL workload cut off from the
    /// banks: every packet to and from its port dropped (open connections
    /// stall mid-statement, new ones do not connect), healed at the end of
    /// the fault. Only in that workload.
    PartitionPostgres,
    /// A power cut: every node, and every bank with a store of its own,
    /// killed (-9) at once, then everything they wrote and did not fsync
    /// thrown away (each data directory is a lossy FUSE mount, `power`;
    /// some cuts torn: each file keeps a seeded prefix of its unsynced
    /// writes); some cuts hold the leader's log sync first (the
    /// `raft_log_flush` refusal point), so its newest entries are on its
    /// followers' disks and not on its own. At the end of the fault the old
    /// leader is started first, then the other nodes, then the banks.
    PowerCut,
}

impl Fault {
    pub const ALL: [Fault; 18] = [
        Fault::KillLeader,
        Fault::KillNode,
        Fault::KillAllNodes,
        Fault::KillParticipant,
        Fault::PauseLeader,
        Fault::PartitionIsolate,
        Fault::PartitionMajority,
        Fault::PartitionBridge,
        Fault::PartitionLeaderParticipants,
        Fault::PartitionLeaderFollowers,
        Fault::ClockSkew,
        Fault::CrashPoint,
        Fault::MessageChaos,
        Fault::ParticipantGone,
        Fault::DiskFull,
        Fault::KillPostgres,
        Fault::PartitionPostgres,
        Fault::PowerCut,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::KillLeader => "kill-leader",
            Fault::KillNode => "kill-node",
            Fault::KillAllNodes => "kill-all-nodes",
            Fault::KillParticipant => "kill-participant",
            Fault::PauseLeader => "pause-leader",
            Fault::PartitionIsolate => "partition-isolate",
            Fault::PartitionMajority => "partition-majority",
            Fault::PartitionBridge => "partition-bridge",
            Fault::PartitionLeaderParticipants => "partition-leader-participants",
            Fault::PartitionLeaderFollowers => "partition-leader-followers",
            Fault::ClockSkew => "clock-skew",
            Fault::CrashPoint => "crash-point",
            Fault::MessageChaos => "message-chaos",
            Fault::ParticipantGone => crate::checker::GONE_FAULT,
            Fault::DiskFull => "disk-full",
            Fault::KillPostgres => "kill-postgres",
            Fault::PartitionPostgres => "partition-postgres",
            Fault::PowerCut => "power-cut",
        }
    }

    pub fn is_partition(self) -> bool {
        self.name().starts_with("partition-")
    }
}

/// The order `kill-all-nodes` and `power-cut` restart the nodes in: the
/// old leader `first` (the node whose reads and phase two must include
/// every write it acknowledged, ADR 0023; after a power cut, the one whose
/// unsynced log tail is gone while its followers may hold it), then the
/// others.
pub fn restart_order(first: u64) -> impl Iterator<Item = u64> {
    std::iter::once(first).chain((1..=3).filter(move |i| *i != first))
}

/// The crash points of docs/design.md#fault-points, as named in the code: the
/// participant ones fire in bank services, the coordinator ones in nodes.
pub const PARTICIPANT_POINTS: [&str; 3] = [
    "participant_before_durable_prepare",
    "participant_after_prepare_before_reply",
    "participant_after_decision_before_ack",
];
/// `coordinator_after_reserve` fires when a leader reserves txids for the
/// one-write commit path (ADR 0012): the first transfer of each term.
pub const COORDINATOR_POINTS: [&str; 7] = [
    "coordinator_after_reserve",
    "coordinator_after_begin",
    "coordinator_before_prepare",
    "coordinator_mid_prepare",
    "coordinator_votes_in_before_decide",
    "coordinator_decided_before_delivery",
    "coordinator_mid_delivery",
];

/// The branch workload's crash points (`--workload branches`): the banks
/// join as branches from their `Change` handlers, so no Prepare reaches
/// them and the Prepare-path points (`participant_before_durable_prepare`,
/// `participant_after_prepare_before_reply`, `coordinator_before_prepare`,
/// `coordinator_mid_prepare`, the one-write commit's) are not on its path.
/// Its participant points: a branch prepared and marked, not yet
/// registered; registered, its caller not yet answered; a decision applied,
/// not yet acked. Its coordinator points: a Begin recorded, not answered; a
/// registration recorded, not answered; midway through delivery.
pub const BRANCH_PARTICIPANT_POINTS: [&str; 3] = [
    "participant_branch_prepared_before_register",
    "participant_branch_registered_before_answer",
    "participant_after_decision_before_ack",
];
pub const BRANCH_COORDINATOR_POINTS: [&str; 3] = [
    "coordinator_after_begin",
    "coordinator_branch_registered_before_reply",
    "coordinator_mid_delivery",
];

/// The saga workload's crash points: the leader's orchestrator ones fire in
/// nodes, the step ones in step services. The points above sit on the 2PC
/// paths, which that workload does not take.
pub const SAGA_COORDINATOR_POINTS: [&str; 4] = [
    "saga_before_forward_call",
    "saga_after_reply_before_journal",
    "saga_after_pivot",
    "saga_mid_compensation",
];
pub const SAGA_STEP_POINTS: [&str; 2] = [
    "step_forward_after_commit_before_reply",
    "step_compensation_after_commit_before_reply",
];

/// Parses a comma-separated list of fault names; `all` means every fault,
/// `none` none. Unknown names are an error that lists the known ones.
pub fn parse_list(s: &str) -> Result<Vec<Fault>, String> {
    let mut out = Vec::new();
    for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        match name {
            "all" => out.extend(Fault::ALL),
            "none" => {}
            "partition" => out.extend(Fault::ALL.into_iter().filter(|f| f.is_partition())),
            "kill" => out.extend([
                Fault::KillLeader,
                Fault::KillNode,
                Fault::KillAllNodes,
                Fault::KillParticipant,
            ]),
            _ => match Fault::ALL.into_iter().find(|f| f.name() == name) {
                Some(f) => out.push(f),
                None => {
                    let known: Vec<&str> = Fault::ALL.iter().map(|f| f.name()).collect();
                    return Err(format!(
                        "unknown nemesis {name:?}; known: {}, or the groups all, kill, partition, none",
                        known.join(", ")
                    ));
                }
            },
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// How the `n`-th power cut of a run (from 0) is made: whether the
/// leader's log sync is held first, and whether the cut is torn. The four
/// kinds in turn, the held clean cut first (so that a run with one cut, as
/// the CI smoke run, has the case of ADR 0028's crash table).
pub fn power_cut_kind(n: u64) -> (bool, bool) {
    match n % 4 {
        0 => (true, false),
        1 => (false, true),
        2 => (false, false),
        _ => (true, true),
    }
}

/// The order of faults: rounds in which every enabled fault comes once, in
/// an order shuffled from the seed; crash points rotate through the list.
pub struct Schedule {
    faults: Vec<Fault>,
    round: Vec<Fault>,
    rng: StdRng,
    next_point: usize,
}

impl Schedule {
    pub fn new(seed: u64, faults: &[Fault]) -> Schedule {
        Schedule {
            faults: faults.to_vec(),
            round: Vec::new(),
            rng: StdRng::seed_from_u64(seed),
            next_point: 0,
        }
    }

    pub fn next_fault(&mut self) -> Option<Fault> {
        if self.round.is_empty() {
            self.round = self.faults.clone();
            self.round.shuffle(&mut self.rng);
            self.round.reverse();
        }
        self.round.pop()
    }

    /// The next crash point: (point, true if it fires in a participant).
    pub fn next_crash_point(&mut self) -> (&'static str, bool) {
        let all: Vec<(&'static str, bool)> = PARTICIPANT_POINTS
            .iter()
            .map(|p| (*p, true))
            .chain(COORDINATOR_POINTS.iter().map(|p| (*p, false)))
            .collect();
        let p = all[self.next_point % all.len()];
        self.next_point += 1;
        p
    }

    /// The next crash point of the branch workload: (point, true if it
    /// fires in a participant).
    pub fn next_branch_crash_point(&mut self) -> (&'static str, bool) {
        let all: Vec<(&'static str, bool)> = BRANCH_PARTICIPANT_POINTS
            .iter()
            .map(|p| (*p, true))
            .chain(BRANCH_COORDINATOR_POINTS.iter().map(|p| (*p, false)))
            .collect();
        let p = all[self.next_point % all.len()];
        self.next_point += 1;
        p
    }

    /// The next crash point of the saga workload: (point, true if it
    /// fires in a step service).
    pub fn next_saga_crash_point(&mut self) -> (&'static str, bool) {
        let all: Vec<(&'static str, bool)> = SAGA_STEP_POINTS
            .iter()
            .map(|p| (*p, true))
            .chain(SAGA_COORDINATOR_POINTS.iter().map(|p| (*p, false)))
            .collect();
        let p = all[self.next_point % all.len()];
        self.next_point += 1;
        p
    }

    pub fn rng(&mut self) -> &mut StdRng {
        &mut self.rng
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_unknown_ones_are_refused_with_the_list() {
        assert_eq!(parse_list("kill-leader,pause-leader").unwrap().len(), 2);
        assert_eq!(parse_list("all").unwrap().len(), Fault::ALL.len());
        assert_eq!(parse_list("partition").unwrap().len(), 6);
        assert!(parse_list("partition").unwrap().contains(&Fault::PartitionPostgres));
        assert!(parse_list("none").unwrap().is_empty());
        let err = parse_list("kill-leader,explode").unwrap_err();
        assert!(err.contains("\"explode\"") && err.contains("clock-skew"), "{err}");
        let both = parse_list("participant-gone,disk-full").unwrap();
        assert_eq!(both, vec![Fault::ParticipantGone, Fault::DiskFull]);
        assert!(parse_list("all").unwrap().contains(&Fault::ParticipantGone));
        assert!(parse_list("all").unwrap().contains(&Fault::DiskFull));
        assert!(parse_list("all").unwrap().contains(&Fault::KillPostgres));
        assert!(parse_list("kill").unwrap().contains(&Fault::KillAllNodes));
        assert!(parse_list("all").unwrap().contains(&Fault::PowerCut));
        assert_eq!(parse_list("power-cut").unwrap(), vec![Fault::PowerCut]);
        // Not in `kill`: it needs FUSE and root, the kills do not.
        assert!(!parse_list("kill").unwrap().contains(&Fault::PowerCut));
        let kinds: Vec<(bool, bool)> = (0..4).map(power_cut_kind).collect();
        assert_eq!(kinds[0], (true, false), "the first cut holds the leader's sync");
        let mut distinct = kinds.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 4, "every kind within four cuts");
        assert_eq!(restart_order(2).collect::<Vec<_>>(), vec![2, 1, 3]);
    }

    #[test]
    fn every_round_has_every_fault_once_and_the_seed_fixes_the_order() {
        let all = parse_list("all").unwrap();
        let mut a = Schedule::new(7, &all);
        let mut b = Schedule::new(7, &all);
        let round: Vec<Fault> = (0..all.len()).map(|_| a.next_fault().unwrap()).collect();
        let again: Vec<Fault> = (0..all.len()).map(|_| b.next_fault().unwrap()).collect();
        assert_eq!(round, again);
        let mut sorted = round.clone();
        sorted.sort();
        assert_eq!(sorted, all);
        assert!(Schedule::new(1, &[]).next_fault().is_none());
    }

    #[test]
    fn crash_points_rotate_through_all_ten() {
        let mut s = Schedule::new(1, &[Fault::CrashPoint]);
        let mut seen: Vec<&str> = (0..10).map(|_| s.next_crash_point().0).collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 10);
        assert!(seen.contains(&"coordinator_after_reserve"));
    }

    #[test]
    fn branch_crash_points_rotate_through_all_six_with_the_branch_windows() {
        let mut s = Schedule::new(1, &[Fault::CrashPoint]);
        let seen: Vec<(&str, bool)> = (0..6).map(|_| s.next_branch_crash_point()).collect();
        let mut names: Vec<&str> = seen.iter().map(|p| p.0).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), 6);
        for p in [
            "participant_branch_prepared_before_register",
            "participant_branch_registered_before_answer",
            "coordinator_branch_registered_before_reply",
        ] {
            assert!(names.contains(&p), "{p} is armed in the branch workload");
        }
        assert_eq!(seen.iter().filter(|p| p.1).count(), 3, "three fire in banks");
        // The Prepare path's points are not on the branch path.
        assert!(!names.contains(&"participant_before_durable_prepare"));
    }

    #[test]
    fn saga_crash_points_rotate_through_all_six() {
        let mut s = Schedule::new(1, &[Fault::CrashPoint]);
        let seen: Vec<(&str, bool)> = (0..6).map(|_| s.next_saga_crash_point()).collect();
        let mut names: Vec<&str> = seen.iter().map(|p| p.0).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), 6);
        assert_eq!(seen.iter().filter(|p| p.1).count(), 2, "two fire in step services");
    }
}
