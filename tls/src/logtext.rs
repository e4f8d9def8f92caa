//! Text a caller chose, made safe for a log line or an error message, and log
//! lines summed up per key (invariant 12: a caller that has not authenticated
//! costs a node bounded log; docs/adr/0038-bounded-logs-and-labels.md).
//!
//! - [`clean`] / [`Clean`]: every string a caller supplied (a method
//!   path, a participant id or address, an idempotency key, a
//!   certificate's subject, an `on-behalf-of` header, a saga or step
//!   name, a participant's or step service's error text) goes through it
//!   before it reaches a log line or an error message. Control characters
//!   (newlines among them), Unicode line and paragraph separators and
//!   bidirectional overrides are escaped (`\n`, `\r`, `\t`, `\\`,
//!   `\u{..}`), so one call writes at most one line and cannot forge
//!   another; the escaped text is cut at [`CALLER_TEXT_BYTES_MAX`] bytes
//!   with a marker saying how many bytes of the original were left out
//!   (`…[+N bytes]`).
//! - [`LogSummary`]: lines that a caller (or a routine outage) can make
//!   as often as it likes are logged once per key per
//!   [`SUMMARY_INTERVAL`]; the others are held back and counted, and the
//!   count is logged as one summary line per key when the interval is
//!   over (by [`LogSummary::spawn_flusher`]) or with the key's next line.
//!   At most [`SUMMARY_KEYS_MAX`] keys are kept; past that, new keys share
//!   the key [`OTHER_KEY`].

use std::collections::HashMap;
use std::fmt;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use std::time::Instant;

/// Longest escaped caller text in a log line or an error message, in
/// bytes; the marker comes after it.
pub const CALLER_TEXT_BYTES_MAX: usize = 256;

/// Lines per key that a [`LogSummary`] lets through: one per this long.
pub const SUMMARY_INTERVAL: Duration = Duration::from_secs(10);

/// Keys a [`LogSummary`] keeps at most.
pub const SUMMARY_KEYS_MAX: usize = 256;

/// The key new keys share once [`SUMMARY_KEYS_MAX`] are kept.
pub const OTHER_KEY: &str = "(other keys)";

/// `s`, escaped and bounded (see the module documentation).
pub fn clean(s: &str) -> String {
    Clean(s).to_string()
}

/// Displays its text escaped and bounded, like [`clean`], without
/// building a string first: `warn!(participant = %Clean(&id), ..)`.
#[derive(Clone, Copy, Debug)]
pub struct Clean<'a>(pub &'a str);

impl fmt::Display for Clean<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut written = 0usize;
        let mut buf = String::with_capacity(12);
        for (at, c) in self.0.char_indices() {
            buf.clear();
            escape(c, &mut buf);
            if written + buf.len() > CALLER_TEXT_BYTES_MAX {
                return write!(f, "…[+{} bytes]", self.0.len() - at);
            }
            f.write_str(&buf)?;
            written += buf.len();
        }
        Ok(())
    }
}

/// Characters that would start a new line, or hide or reorder what
/// follows on a terminal.
fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
        )
}

fn escape(c: char, out: &mut String) {
    match c {
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        '\\' => out.push_str("\\\\"),
        c if needs_escape(c) => {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        }
        c => out.push(c),
    }
}

#[derive(Debug)]
struct Entry {
    /// When this key's last line (or summary) was written.
    logged_at: Instant,
    /// Lines held back since.
    held: u64,
}

/// Lets one line per key per interval through and counts the others; see
/// the module documentation.
#[derive(Debug)]
pub struct LogSummary {
    interval: Duration,
    keys_max: usize,
    map: Mutex<HashMap<String, Entry>>,
}

impl Default for LogSummary {
    fn default() -> Self {
        LogSummary::new(SUMMARY_INTERVAL, SUMMARY_KEYS_MAX)
    }
}

impl LogSummary {
    pub fn new(interval: Duration, keys_max: usize) -> LogSummary {
        LogSummary {
            interval,
            keys_max: keys_max.max(1),
            map: Mutex::new(HashMap::new()),
        }
    }

    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// A line for `key` is about to be written: `Some(held)` when it is to
    /// be (with how many lines for the key were held back since its last
    /// one), `None` when it is held back (and counted).
    pub fn note(&self, key: &str) -> Option<u64> {
        self.note_at(key, Instant::now())
    }

    /// [`LogSummary::note`] at `now`.
    pub fn note_at(&self, key: &str, now: Instant) -> Option<u64> {
        let mut map = self.map.lock().expect("log summary lock");
        // One place is kept for the shared key: the others hold at most
        // `keys_max - 1`.
        let own_max = self.keys_max.saturating_sub(1).max(1);
        let own = |map: &HashMap<String, Entry>| map.len() - usize::from(map.contains_key(OTHER_KEY));
        let key = if map.contains_key(key) || own(&map) < own_max {
            key
        } else {
            // Forget the keys that have nothing to report and whose
            // interval is over: their next line would pass anyway.
            let interval = self.interval;
            map.retain(|_, e| e.held > 0 || now.saturating_duration_since(e.logged_at) < interval);
            if own(&map) < own_max {
                key
            } else {
                OTHER_KEY
            }
        };
        match map.get_mut(key) {
            None => {
                map.insert(
                    key.to_string(),
                    Entry {
                        logged_at: now,
                        held: 0,
                    },
                );
                Some(0)
            }
            Some(e) if now.saturating_duration_since(e.logged_at) >= self.interval => {
                e.logged_at = now;
                Some(std::mem::take(&mut e.held))
            }
            Some(e) => {
                e.held += 1;
                None
            }
        }
    }

    /// The keys whose held-back lines are due for a summary at `now` (their
    /// last line is an interval old), with how many; their count starts
    /// over. Keys with nothing held and an interval old are forgotten.
    pub fn due_at(&self, now: Instant) -> Vec<(String, u64)> {
        let mut map = self.map.lock().expect("log summary lock");
        let interval = self.interval;
        let mut out = Vec::new();
        map.retain(|k, e| {
            if now.saturating_duration_since(e.logged_at) < interval {
                return true;
            }
            if e.held == 0 {
                return false;
            }
            out.push((k.clone(), std::mem::take(&mut e.held)));
            e.logged_at = now;
            true
        });
        out.sort();
        out
    }

    /// Keys kept now.
    pub fn keys(&self) -> usize {
        self.map.lock().expect("log summary lock").len()
    }

    /// Calls `log(key, held)` for every key due (see
    /// [`LogSummary::due_at`]) once per interval, on a tokio task that
    /// ends when the last other reference to `self` is gone. Does nothing
    /// outside a tokio runtime.
    pub fn spawn_flusher(self: &Arc<Self>, log: impl Fn(&str, u64) + Send + 'static) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let weak = Arc::downgrade(self);
        let every = self.interval;
        rt.spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(me) = weak.upgrade() else { return };
                for (key, held) in me.due_at(Instant::now()) {
                    log(&key, held);
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inv12_control_characters_are_escaped_so_one_call_writes_one_line() {
        assert_eq!(clean("bank-a"), "bank-a");
        assert_eq!(clean("größe ünïcode ✓"), "größe ünïcode ✓", "printable text is kept");
        let forged = "x\n2025-01-01T00:00:00Z  INFO coordinator: forged\r\tline";
        let c = clean(forged);
        assert!(!c.contains('\n') && !c.contains('\r') && !c.contains('\t'), "{c}");
        assert_eq!(c, "x\\n2025-01-01T00:00:00Z  INFO coordinator: forged\\r\\tline");
        assert_eq!(clean("a\u{1b}[31mred\u{0}"), "a\\u{1b}[31mred\\u{0}");
        assert_eq!(clean("l\u{2028}s\u{202e}r"), "l\\u{2028}s\\u{202e}r");
        assert_eq!(clean("back\\n"), "back\\\\n", "a literal backslash-n is not a newline");
        assert_eq!(format!("{}", Clean("p\nq")), "p\\nq");
    }

    #[test]
    fn inv12_long_text_is_cut_at_the_bound_with_a_marker() {
        let long = "/dtx.v1.Coordinator/".to_string() + &"A".repeat(3500);
        let c = clean(&long);
        assert!(c.len() <= CALLER_TEXT_BYTES_MAX + 20, "{} bytes", c.len());
        assert!(c.starts_with("/dtx.v1.Coordinator/AAAA"));
        assert!(
            c.ends_with(&format!("…[+{} bytes]", long.len() - CALLER_TEXT_BYTES_MAX)),
            "{c}"
        );
        let exact = "b".repeat(CALLER_TEXT_BYTES_MAX);
        assert_eq!(clean(&exact), exact, "text at the bound is whole");
        // Escapes count against the bound; a character is never split.
        let newlines = "\n".repeat(1000);
        let c = clean(&newlines);
        assert!(c.starts_with("\\n\\n") && c.len() <= CALLER_TEXT_BYTES_MAX + 20, "{c}");
        assert!(
            c.ends_with(&format!("…[+{} bytes]", 1000 - CALLER_TEXT_BYTES_MAX / 2)),
            "{c}"
        );
        let wide = "é".repeat(200);
        let c = clean(&wide);
        assert!(c.starts_with(&"é".repeat(CALLER_TEXT_BYTES_MAX / 2)), "{c}");
        assert!(c.ends_with("…[+144 bytes]"), "{c}");
    }

    #[test]
    fn inv12_one_line_per_key_per_interval_and_the_rest_counted() {
        let s = LogSummary::new(Duration::from_secs(10), 8);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert_eq!(s.note_at("a", at(0)), Some(0), "the first line passes");
        for i in 1..=1999 {
            assert_eq!(s.note_at("a", at(i)), None, "held back at {i} ms");
        }
        assert_eq!(s.note_at("b", at(5)), Some(0), "another key has its own line");
        assert!(s.due_at(at(9_999)).is_empty(), "nothing due within the interval");
        assert_eq!(s.due_at(at(10_000)), vec![("a".to_string(), 1999)], "b held nothing");
        assert_eq!(s.keys(), 2, "b is still within its interval");
        assert!(s.due_at(at(10_001)).is_empty(), "a's count started over");
        assert_eq!(s.note_at("a", at(12_000)), None);
        assert_eq!(
            s.note_at("a", at(20_000)),
            Some(1),
            "the next line says what was held back"
        );
        assert!(s.due_at(at(40_000)).is_empty());
        assert_eq!(s.keys(), 0, "keys with nothing to say are forgotten");
    }

    #[test]
    fn inv12_many_keys_share_one_past_the_bound() {
        let s = LogSummary::new(Duration::from_secs(10), 4);
        let t0 = Instant::now();
        let passed = (0..1000)
            .filter(|i| s.note_at(&format!("caller-{i}"), t0).is_some())
            .count();
        assert!(s.keys() <= 4, "{} keys", s.keys());
        assert_eq!(passed, 4, "three keys of their own and the shared one");
        let due = s.due_at(t0 + Duration::from_secs(10));
        assert_eq!(
            due,
            vec![(OTHER_KEY.to_string(), 996)],
            "the rest counted under the shared key"
        );
        // An interval later, idle keys make room again.
        assert_eq!(s.note_at("late", t0 + Duration::from_secs(30)), Some(0));
    }
}
