//! CPU time of the processes a benchmark runs (Linux): steadier than
//! throughput on a shared machine, because it counts the work done, not how
//! much of the machine the run happened to get.

use std::time::Duration;

/// User + system CPU time of process `pid` so far, from `/proc/<pid>/stat`;
/// `None` if the process is gone or the file cannot be read.
pub fn process_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (utime, stime) = parse_stat_ticks(&stat)?;
    Some(ticks(utime.saturating_add(stime)))
}

/// User + system CPU time of this process so far (every thread).
pub fn self_cpu() -> Duration {
    // SAFETY: getrusage(2) fills the zeroed struct; no pointer is kept.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, (t.tv_usec as u32).saturating_mul(1000));
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// `utime` and `stime` (fields 14 and 15, in clock ticks) of a
/// `/proc/<pid>/stat` line. The command name (field 2) is in parentheses
/// and may itself hold spaces and parentheses, so fields are counted from
/// the last `)`.
pub fn parse_stat_ticks(stat: &str) -> Option<(u64, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After the name: field 3 (state) is the first, so utime (14) is the
    // 12th and stime (15) the 13th.
    let mut fields = rest.split_whitespace();
    let utime = fields.nth(11)?.parse().ok()?;
    let stime = fields.next()?.parse().ok()?;
    Some((utime, stime))
}

fn ticks(n: u64) -> Duration {
    // SAFETY: sysconf(3) reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as u64 } else { 100 };
    Duration::from_nanos(n.saturating_mul(1_000_000_000) / hz)
}

/// Which kind of process a measured child is, for CPU figures split by
/// process ([`CpuSample::split_since`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// One of our nodes, by node id (the leader of a phase is found by it).
    Node(u64),
    /// A participant service (a bank).
    Bank,
    /// Anything else (etcd, PostgreSQL): counted in the total only.
    Other,
}

/// CPU time summed over this process and the given child processes, for
/// "CPU per operation" figures: sample before and after a phase, divide
/// the difference by the operations done.
pub struct CpuMeter {
    pids: Vec<(Part, u32)>,
}

impl CpuMeter {
    pub fn new(pids: Vec<u32>) -> CpuMeter {
        CpuMeter::with_parts(pids.into_iter().map(|p| (Part::Other, p)).collect())
    }

    /// Children named by kind, so that a phase's CPU can also be split by
    /// process.
    pub fn with_parts(pids: Vec<(Part, u32)>) -> CpuMeter {
        CpuMeter { pids }
    }

    /// This process's CPU time plus each child's so far (a child that is
    /// gone counts 0, so keep them running across a measured phase).
    pub fn sample(&self) -> Duration {
        self.sample_parts().total()
    }

    /// Each child's CPU time so far and this process's.
    pub fn sample_parts(&self) -> CpuSample {
        CpuSample {
            children: self.pids.iter().map(|&(part, pid)| (part, process_cpu(pid))).collect(),
            own: self_cpu(),
        }
    }
}

/// CPU times read at one moment by [`CpuMeter::sample_parts`].
#[derive(Debug, Clone)]
pub struct CpuSample {
    children: Vec<(Part, Option<Duration>)>,
    own: Duration,
}

/// The CPU of one phase per operation, by process, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct CpuSplit {
    /// The node that led the phase.
    pub leader_us: u64,
    /// Each other node (their mean).
    pub follower_us: u64,
    /// Each participant service (their mean).
    pub bank_us: u64,
    /// The benchmark's own process (its clients).
    pub client_us: u64,
}

impl CpuSample {
    /// Every process's CPU time summed.
    pub fn total(&self) -> Duration {
        self.children.iter().filter_map(|(_, d)| *d).sum::<Duration>() + self.own
    }

    /// What each kind of process used since `before` (taken from the same
    /// meter), per operation of `ops`, with node `leader` as the leader.
    /// `None` without operations, without the leader among the nodes, or
    /// when a node or bank could not be read at either end (a figure
    /// missing one of them would be wrong, not rough).
    pub fn split_since(&self, before: &CpuSample, leader: u64, ops: u64) -> Option<CpuSplit> {
        if ops == 0 || self.children.len() != before.children.len() {
            return None;
        }
        let mut leader_us = None;
        let (mut followers, mut banks) = (Vec::new(), Vec::new());
        for ((part, after), (_, was)) in self.children.iter().zip(&before.children) {
            let used = || Some(after.as_ref()?.saturating_sub((*was)?).as_micros() as u64);
            match part {
                Part::Node(id) if *id == leader => leader_us = Some(used()?),
                Part::Node(_) => followers.push(used()?),
                Part::Bank => banks.push(used()?),
                Part::Other => {}
            }
        }
        let mean = |v: &[u64]| v.iter().sum::<u64>().checked_div(v.len() as u64).unwrap_or(0);
        Some(CpuSplit {
            leader_us: leader_us? / ops,
            follower_us: mean(&followers) / ops,
            bank_us: mean(&banks) / ops,
            client_us: self.own.saturating_sub(before.own).as_micros() as u64 / ops,
        })
    }
}

impl CpuSplit {
    /// `leader 790 us, each follower 350 us, each bank 300 us, the bench
    /// client 80 us` (microseconds: at 64 clients a follower's share is
    /// tens of them).
    pub fn line(&self) -> String {
        format!(
            "leader {} us, each follower {} us, each bank {} us, the bench client {} us",
            self.leader_us, self.follower_us, self.bank_us, self.client_us
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_from_the_last_parenthesis() {
        // A command name with spaces and parentheses in it.
        let line = "4242 (coord (x) y) S 1 4242 4242 0 -1 4194560 1000 0 0 0 1234 567 0 0 20 0 9 0 100 0 0";
        assert_eq!(parse_stat_ticks(line), Some((1234, 567)));
        assert_eq!(parse_stat_ticks("4242 (short"), None);
        assert_eq!(parse_stat_ticks("4242 (x) S 1 2"), None);
    }

    fn at(children: &[(Part, Option<u64>)], own_ms: u64) -> CpuSample {
        CpuSample {
            children: children
                .iter()
                .map(|&(p, ms)| (p, ms.map(Duration::from_millis)))
                .collect(),
            own: Duration::from_millis(own_ms),
        }
    }

    #[test]
    fn a_phase_splits_into_leader_followers_banks_and_client_per_operation() {
        let parts = |n1, n2, n3, b1, b2| {
            [
                (Part::Node(1), n1),
                (Part::Node(2), n2),
                (Part::Node(3), n3),
                (Part::Bank, b1),
                (Part::Bank, b2),
                (Part::Other, None),
            ]
        };
        let before = at(&parts(Some(100), Some(50), Some(60), Some(10), Some(20)), 5);
        // 1000 operations: node 2 led (800 ms), the others 350 and 360 ms,
        // the banks 300 and 310 ms, this process 80 ms.
        let after = at(&parts(Some(450), Some(850), Some(420), Some(310), Some(330)), 85);
        let split = after.split_since(&before, 2, 1000).expect("split");
        assert_eq!(
            split,
            CpuSplit {
                leader_us: 800,
                follower_us: 355,
                bank_us: 305,
                client_us: 80
            }
        );
        assert_eq!(
            split.line(),
            "leader 800 us, each follower 355 us, each bank 305 us, the bench client 80 us"
        );
        assert_eq!(after.total(), Duration::from_millis(450 + 850 + 420 + 310 + 330 + 85));
        // No operations, a leader not among the nodes, or a process not
        // read at one end: no split.
        assert_eq!(after.split_since(&before, 2, 0), None);
        assert_eq!(after.split_since(&before, 9, 1000), None);
        let gone = at(&parts(Some(450), None, Some(420), Some(310), Some(330)), 85);
        assert_eq!(gone.split_since(&before, 1, 1000), None);
        assert_eq!(after.split_since(&at(&[], 5), 2, 1000), None);
    }

    #[test]
    fn own_cpu_grows_with_work_and_children_are_read_from_proc() {
        let before = self_cpu();
        let mut x = 0u64;
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_millis(200) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let after = self_cpu();
        assert!(after > before, "{before:?} -> {after:?}");
        // This process read through /proc as a "child" agrees roughly.
        let me = process_cpu(std::process::id()).expect("own /proc stat");
        assert!(me + Duration::from_millis(100) >= before, "{me:?} vs {before:?}");
        assert_eq!(process_cpu(u32::MAX), None);
    }
}
