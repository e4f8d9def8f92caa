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

/// CPU time summed over this process and the given child processes, for
/// "CPU per operation" figures: sample before and after a phase, divide
/// the difference by the operations done.
pub struct CpuMeter {
    pids: Vec<u32>,
}

impl CpuMeter {
    pub fn new(pids: Vec<u32>) -> CpuMeter {
        CpuMeter { pids }
    }

    /// This process's CPU time plus each child's so far (a child that is
    /// gone counts 0, so keep them running across a measured phase).
    pub fn sample(&self) -> Duration {
        self.pids.iter().filter_map(|&p| process_cpu(p)).sum::<Duration>() + self_cpu()
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
