//! Facts about the machine a benchmark runs on that move its latencies
//! without any change of ours: how many CPUs, which kernel, and how an idle
//! CPU waits for work. On a KVM guest with the `haltpoll` cpuidle driver,
//! `guest_halt_poll_ns` is how long an idle vCPU polls before it halts;
//! at 0 it halts at once, and every message to a process whose vCPU is idle
//! waits for the hypervisor to wake that vCPU (docs/benchmarks.md measured
//! up to a quarter of a one-client transfer so; docs/operations.md, "Commit
//! latency on virtual machines").

use std::path::Path;

use serde::Serialize;

/// What the bench records of the machine (`machine` in results.json).
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
pub struct Machine {
    pub cpus: usize,
    /// `/proc/sys/kernel/osrelease`.
    pub kernel: Option<String>,
    /// `/sys/devices/system/cpu/cpuidle/current_driver`.
    pub cpuidle_driver: Option<String>,
    /// `/sys/module/haltpoll/parameters/guest_halt_poll_ns`: only where the
    /// haltpoll driver is loaded.
    pub guest_halt_poll_ns: Option<u64>,
}

impl Machine {
    /// This machine's facts; a fact that cannot be read is `None`.
    pub fn read() -> Machine {
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
        Machine::read_from(Path::new("/"), cpus)
    }

    /// The facts under `root` (a stand-in for `/` in tests).
    pub fn read_from(root: &Path, cpus: usize) -> Machine {
        let text = |rel: &str| {
            std::fs::read_to_string(root.join(rel))
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        };
        Machine {
            cpus,
            kernel: text("proc/sys/kernel/osrelease"),
            cpuidle_driver: text("sys/devices/system/cpu/cpuidle/current_driver"),
            guest_halt_poll_ns: text("sys/module/haltpoll/parameters/guest_halt_poll_ns").and_then(|s| s.parse().ok()),
        }
    }

    /// One line for the run's header, e.g. "2 CPUs; kernel 6.1.0; cpuidle
    /// driver haltpoll, guest_halt_poll_ns 0 (an idle vCPU halts at once:
    /// ...)".
    pub fn line(&self) -> String {
        let mut s = format!(
            "{} CPUs; kernel {}; cpuidle driver {}",
            self.cpus,
            self.kernel.as_deref().unwrap_or("unknown"),
            self.cpuidle_driver.as_deref().unwrap_or("unknown")
        );
        match self.guest_halt_poll_ns {
            Some(0) => s.push_str(
                ", guest_halt_poll_ns 0 (an idle vCPU halts at once: each wake-up of an idle process waits for the hypervisor)",
            ),
            Some(ns) => s.push_str(&format!(
                ", guest_halt_poll_ns {ns} (an idle vCPU polls up to {} us before it halts)",
                ns / 1000
            )),
            None => {}
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KERNEL: &str = "proc/sys/kernel/osrelease";
    const DRIVER: &str = "sys/devices/system/cpu/cpuidle/current_driver";
    const HALT_POLL: &str = "sys/module/haltpoll/parameters/guest_halt_poll_ns";

    /// The facts read from a stand-in root holding only `files`.
    fn read_with(files: &[(&str, &str)], cpus: usize) -> Machine {
        let root = tempfile::tempdir().unwrap();
        for (rel, body) in files {
            let p = root.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, body).unwrap();
        }
        Machine::read_from(root.path(), cpus)
    }

    #[test]
    fn a_kvm_guest_whose_idle_vcpus_halt_at_once() {
        let m = read_with(
            &[(KERNEL, "6.18.44-fc\n"), (DRIVER, "haltpoll\n"), (HALT_POLL, "0\n")],
            2,
        );
        assert_eq!(
            m,
            Machine {
                cpus: 2,
                kernel: Some("6.18.44-fc".into()),
                cpuidle_driver: Some("haltpoll".into()),
                guest_halt_poll_ns: Some(0),
            }
        );
        let line = m.line();
        assert!(
            line.starts_with(
                "2 CPUs; kernel 6.18.44-fc; cpuidle driver haltpoll, guest_halt_poll_ns 0 (an idle vCPU halts at once"
            ),
            "{line}"
        );
    }

    #[test]
    fn a_guest_whose_idle_vcpus_poll_first() {
        let m = read_with(&[(DRIVER, "haltpoll"), (HALT_POLL, "200000")], 4);
        assert_eq!(m.guest_halt_poll_ns, Some(200_000));
        assert!(m
            .line()
            .ends_with("guest_halt_poll_ns 200000 (an idle vCPU polls up to 200 us before it halts)"));
    }

    #[test]
    fn facts_that_cannot_be_read_are_unknown_not_guessed() {
        // A value that is not a number is not read as one.
        let m = read_with(&[(HALT_POLL, "yes")], 8);
        assert_eq!(
            m,
            Machine {
                cpus: 8,
                kernel: None,
                cpuidle_driver: None,
                guest_halt_poll_ns: None,
            }
        );
        assert_eq!(m.line(), "8 CPUs; kernel unknown; cpuidle driver unknown");
    }
}
