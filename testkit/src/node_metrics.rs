//! A node's Prometheus text (its `metrics_addr`), and what the leader's own
//! counters say about a measured phase of the bench: how many Raft entries
//! it built, how many commands each carried, and how long its API handler
//! held each call. The client's latency minus the handler's time is what
//! the call spent outside the leader's handler (the client, the network,
//! hyper on both sides); the entries per second bound the rate of a
//! closed loop whose every call waits for one.

use std::collections::HashMap;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::io::AsyncWriteExt;

/// How long a scrape may take before it counts as failed.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

/// The Prometheus text of the node whose metrics port is `addr` (one HTTP/1.1
/// GET, connection closed after it), headers included.
pub async fn scrape(addr: &str) -> std::io::Result<String> {
    let get = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
            .await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        Ok(out)
    };
    tokio::time::timeout(SCRAPE_TIMEOUT, get)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no answer from {addr}")))?
}

/// The value of the sample named exactly `name` (labels included, as
/// rendered), 0 if absent.
pub fn sample(text: &str, name: &str) -> f64 {
    samples(text).get(name).copied().unwrap_or(0.0)
}

/// Every sample of `text`: its name with its labels as rendered, and its
/// value. Comments and lines that do not parse are skipped.
pub fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (n, v) = l.rsplit_once(' ')?;
            Some((n.trim().to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

/// What the leader did during one measured phase, from its counters before
/// and after it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LeaderWork {
    /// Raft entries the batcher built.
    pub raft_entries: u64,
    pub entries_per_sec: f64,
    /// Commands per entry, on average.
    pub commands_per_entry: f64,
    /// The leader's API handler's mean time per successful call of the
    /// phase's method, in µs.
    pub handler_mean_us: Option<u64>,
}

impl LeaderWork {
    /// From the leader's samples `before` and `after` a phase of
    /// `elapsed` whose calls are `method` (for example `Abort`); `None`
    /// when the leader built no entry in between (another node led, or
    /// the scrapes failed).
    pub fn between(
        before: &HashMap<String, f64>,
        after: &HashMap<String, f64>,
        elapsed: Duration,
        method: &str,
    ) -> Option<LeaderWork> {
        let delta = |name: &str| after.get(name).copied().unwrap_or(0.0) - before.get(name).copied().unwrap_or(0.0);
        let entries = delta("dtx_batch_commands_count");
        if entries <= 0.0 || elapsed.is_zero() {
            return None;
        }
        let call = format!("{{method=\"{method}\",code=\"Ok\"}}");
        let calls = delta(&format!("dtx_api_request_seconds_count{call}"));
        let seconds = delta(&format!("dtx_api_request_seconds_sum{call}"));
        Some(LeaderWork {
            raft_entries: entries as u64,
            entries_per_sec: entries / elapsed.as_secs_f64(),
            commands_per_entry: delta("dtx_batch_commands_sum") / entries,
            handler_mean_us: (calls > 0.0).then(|| (seconds / calls * 1e6).round() as u64),
        })
    }

    /// `340 Raft entries/s, 27.7 commands each; Abort held 2.98 ms in the
    /// leader's handler (mean)`.
    pub fn line(&self, method: &str) -> String {
        let mut s = format!(
            "leader: {:.0} Raft entries/s, {:.1} commands each",
            self.entries_per_sec, self.commands_per_entry
        );
        if let Some(us) = self.handler_mean_us {
            s.push_str(&format!(
                "; {method} {:.2} ms in its handler (mean)",
                us as f64 / 1000.0
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = "\
# HELP dtx_batch_commands Commands per Raft entry built by the batcher (leader).
# TYPE dtx_batch_commands histogram
dtx_batch_commands_bucket{le=\"8\"} 3
dtx_batch_commands_sum 120
dtx_batch_commands_count 10
dtx_api_request_seconds_sum{method=\"Abort\",code=\"Ok\"} 1.5
dtx_api_request_seconds_count{method=\"Abort\",code=\"Ok\"} 500
dtx_api_request_seconds_count{method=\"Abort\",code=\"NotFound\"} 7
";

    fn after(entries: u64, commands: u64, abort_s: f64, aborts: u64) -> String {
        format!(
            "dtx_batch_commands_sum {}\ndtx_batch_commands_count {}\n\
             dtx_api_request_seconds_sum{{method=\"Abort\",code=\"Ok\"}} {}\n\
             dtx_api_request_seconds_count{{method=\"Abort\",code=\"Ok\"}} {}\n",
            120 + commands,
            10 + entries,
            1.5 + abort_s,
            500 + aborts
        )
    }

    #[test]
    fn samples_keep_their_labels_and_skip_comments() {
        let s = samples(BEFORE);
        assert_eq!(s.get("dtx_batch_commands_count"), Some(&10.0));
        assert_eq!(s.get("dtx_batch_commands_bucket{le=\"8\"}"), Some(&3.0));
        assert_eq!(
            sample(
                BEFORE,
                "dtx_api_request_seconds_count{method=\"Abort\",code=\"NotFound\"}"
            ),
            7.0
        );
        assert_eq!(sample(BEFORE, "dtx_not_there"), 0.0);
        assert!(!s.keys().any(|k| k.starts_with('#')));
    }

    #[test]
    fn the_leaders_work_is_the_difference_over_the_phase() {
        let w = LeaderWork::between(
            &samples(BEFORE),
            &samples(&after(2000, 55_000, 150.0, 50_000)),
            Duration::from_secs(5),
            "Abort",
        )
        .expect("entries were built");
        assert_eq!(w.raft_entries, 2000);
        assert_eq!(w.entries_per_sec, 400.0);
        assert_eq!(w.commands_per_entry, 27.5);
        assert_eq!(w.handler_mean_us, Some(3000));
        assert_eq!(
            w.line("Abort"),
            "leader: 400 Raft entries/s, 27.5 commands each; Abort 3.00 ms in its handler (mean)"
        );
        // Another method's calls: no handler time, the rest as before.
        let other = LeaderWork::between(
            &samples(BEFORE),
            &samples(&after(2000, 55_000, 150.0, 50_000)),
            Duration::from_secs(5),
            "BeginAndCommit",
        )
        .unwrap();
        assert_eq!(other.handler_mean_us, None);
    }

    #[test]
    fn no_entry_built_is_no_answer() {
        let same = samples(BEFORE);
        assert_eq!(LeaderWork::between(&same, &same, Duration::from_secs(5), "Abort"), None);
        assert_eq!(
            LeaderWork::between(&HashMap::new(), &HashMap::new(), Duration::from_secs(5), "Abort"),
            None
        );
    }
}
