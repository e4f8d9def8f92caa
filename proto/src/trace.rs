//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>) in gRPC
//! metadata: the `traceparent` header that carries a trace across the
//! client, the cluster's nodes and the participants, and `tracestate`,
//! passed through untouched. Dependency-free: parsing and formatting only.
//!
//! `traceparent` is `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`
//! in lowercase. A header that does not follow the specification exactly
//! (wrong length, uppercase or non-hex digits, version `ff`, an all-zero
//! trace id or parent id, more than one `traceparent` header) is ignored,
//! never an error: the receiver then starts a trace of its own. A
//! `tracestate` without a valid `traceparent` is ignored too.

use tonic::codegen::http::HeaderMap;
use tonic::codegen::http::HeaderValue;

/// The gRPC metadata key of the W3C trace parent.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// The gRPC metadata key of the W3C vendor trace state (passed through).
pub const TRACESTATE_HEADER: &str = "tracestate";
/// The longest `tracestate` passed on; a longer one is dropped (the
/// specification asks to propagate at least 512 characters).
pub const TRACESTATE_BYTES_MAX: usize = 512;
/// The `sampled` bit of the trace flags.
pub const FLAG_SAMPLED: u8 = 0x01;

/// A parsed `traceparent`: the trace, the span of the caller (the parent of
/// the receiver's span) and the trace flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceParent {
    /// The trace id (16 bytes, never all zero).
    pub trace_id: u128,
    /// The caller's span id (8 bytes, never all zero).
    pub parent_id: u64,
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TraceParent {
    /// A valid trace parent, or `None` when an id is zero (invalid in W3C).
    pub fn new(trace_id: u128, parent_id: u64, flags: u8) -> Option<TraceParent> {
        (trace_id != 0 && parent_id != 0).then_some(TraceParent {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// Parses a `traceparent` header value as the W3C specification says
    /// (level 1, with its rules for versions above `00`); `None` for any
    /// value that does not follow it.
    pub fn parse(value: &str) -> Option<TraceParent> {
        let b = value.as_bytes();
        // version "-" trace-id "-" parent-id "-" flags: 2+1+32+1+16+1+2.
        if b.len() < 55 {
            return None;
        }
        let version = hex_lc(&b[0..2])? as u8;
        if version == 0xff {
            return None;
        }
        if b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return None;
        }
        // Version 00 is exactly 55 characters; a later version may append
        // fields after another dash.
        if (version == 0 && b.len() != 55) || (version != 0 && b.len() > 55 && b[55] != b'-') {
            return None;
        }
        let trace_id = hex_lc(&b[3..35])?;
        let parent_id = hex_lc(&b[36..52])? as u64;
        let flags = hex_lc(&b[53..55])? as u8;
        TraceParent::new(trace_id, parent_id, flags)
    }

    /// The header value, version `00`.
    pub fn format(&self) -> String {
        format!("00-{:032x}-{:016x}-{:02x}", self.trace_id, self.parent_id, self.flags)
    }

    /// The trace id as 32 lowercase hex digits (how logs show it).
    pub fn trace_id_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// True when the caller sampled (recorded) its span.
    pub fn sampled(&self) -> bool {
        self.flags & FLAG_SAMPLED != 0
    }
}

/// The value of lowercase hex digits (at most 32); `None` for anything else
/// (uppercase digits included: the specification allows lowercase only).
fn hex_lc(digits: &[u8]) -> Option<u128> {
    if digits.is_empty() || digits.len() > 32 {
        return None;
    }
    digits.iter().try_fold(0u128, |acc, &c| {
        let v = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => return None,
        };
        Some(acc << 4 | v as u128)
    })
}

/// The trace a request carries: its `traceparent` (exactly one header, and
/// valid) and its `tracestate` (if at most `TRACESTATE_BYTES_MAX` bytes of
/// visible ASCII; several headers are joined with commas as HTTP says).
/// For a request's gRPC metadata: `trace_of(req.metadata().as_ref())`.
pub fn trace_of(md: &HeaderMap) -> Option<(TraceParent, Option<String>)> {
    let mut values = md.get_all(TRACEPARENT_HEADER).iter();
    let first = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let parent = TraceParent::parse(first.to_str().ok()?)?;
    let states: Option<Vec<&str>> = md.get_all(TRACESTATE_HEADER).iter().map(|v| v.to_str().ok()).collect();
    let state = states
        .map(|s| s.join(","))
        .filter(|s| !s.trim().is_empty() && s.len() <= TRACESTATE_BYTES_MAX);
    Some((parent, state))
}

/// Puts `parent` (and `state`, if any) into a request's metadata, in place
/// of any trace context it had (`req.metadata_mut().as_mut()`).
pub fn attach_trace(md: &mut HeaderMap, parent: &TraceParent, state: Option<&str>) {
    if let Ok(mut v) = HeaderValue::try_from(parent.format()) {
        // Sent as an HPACK literal that is never indexed: the value is new
        // for (almost) every call, so indexing it would only churn both
        // ends' header tables (an insert and an eviction per call).
        v.set_sensitive(true);
        md.insert(TRACEPARENT_HEADER, v);
    }
    md.remove(TRACESTATE_HEADER);
    if let Some(v) = state.and_then(|s| HeaderValue::try_from(s).ok()) {
        md.insert(TRACESTATE_HEADER, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn the_specification_examples_parse_and_format_back() {
        let p = TraceParent::parse(SPEC).expect("valid");
        assert_eq!(p.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(p.parent_id, 0x00f067aa0ba902b7);
        assert_eq!(p.flags, 1);
        assert!(p.sampled());
        assert_eq!(p.format(), SPEC);
        assert_eq!(p.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        let not_sampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        let p = TraceParent::parse(not_sampled).expect("valid");
        assert!(!p.sampled());
        assert_eq!(p.format(), not_sampled);
        // Unknown flags are kept as they came (only "sampled" has a meaning).
        assert_eq!(
            TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09")
                .unwrap()
                .flags,
            9
        );
    }

    #[test]
    fn malformed_values_are_ignored() {
        for bad in [
            "",
            "00",
            // all-zero trace id, all-zero parent id
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // version ff is forbidden
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            // uppercase hex
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0A",
            "0A-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            // not hex
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902bz-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            // wrong lengths and separators
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47366-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 ",
            // version 00 has nothing after the flags
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            // a later version: more fields must follow a dash
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01extra",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_by_its_first_four_fields() {
        for v in [
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-adds",
        ] {
            let p = TraceParent::parse(v).expect(v);
            // Passed on as version 00, the version this code writes.
            assert_eq!(p.format(), SPEC);
        }
    }

    #[test]
    fn metadata_round_trip_and_ignores_duplicates_and_bad_state() {
        let p = TraceParent::parse(SPEC).unwrap();
        let mut md = HeaderMap::new();
        assert_eq!(trace_of(&md), None);
        attach_trace(&mut md, &p, Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"));
        assert_eq!(
            trace_of(&md),
            Some((p, Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7".to_string())))
        );
        // New with every call: never put in the HPACK tables.
        assert!(md.get(TRACEPARENT_HEADER).unwrap().is_sensitive());
        // Attaching again replaces, state included.
        attach_trace(&mut md, &p, None);
        assert_eq!(trace_of(&md), Some((p, None)));
        // Two traceparent headers: ignored.
        md.append(TRACEPARENT_HEADER, SPEC.parse().unwrap());
        assert_eq!(trace_of(&md), None);
        // A state longer than the limit is dropped, the parent kept.
        let mut md = HeaderMap::new();
        attach_trace(&mut md, &p, Some(&format!("k={}", "v".repeat(TRACESTATE_BYTES_MAX))));
        assert_eq!(trace_of(&md), Some((p, None)));
        // A state without a valid parent is ignored with it.
        let mut md = HeaderMap::new();
        md.insert(TRACEPARENT_HEADER, "00-zz".parse().unwrap());
        md.insert(TRACESTATE_HEADER, "a=b".parse().unwrap());
        assert_eq!(trace_of(&md), None);
        // Several tracestate headers are one list.
        let mut md = HeaderMap::new();
        attach_trace(&mut md, &p, Some("a=1"));
        md.append(TRACESTATE_HEADER, "b=2".parse().unwrap());
        assert_eq!(trace_of(&md), Some((p, Some("a=1,b=2".to_string()))));
    }

    #[test]
    fn zero_ids_are_refused_when_built_too() {
        assert_eq!(TraceParent::new(0, 1, 1), None);
        assert_eq!(TraceParent::new(1, 0, 1), None);
        assert_eq!(
            TraceParent::new(1, 1, 1).unwrap().format(),
            "00-00000000000000000000000000000001-0000000000000001-01"
        );
    }
}
