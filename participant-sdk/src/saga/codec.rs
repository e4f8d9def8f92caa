//! The byte encoding of inbox records ([`StepRecord::encode`] and
//! [`StepRecord::decode`]), and the length-prefixed fields the in-flight
//! records of outside calls are made of too.

use super::types::CallKind;
use super::types::StepRecord;
use super::types::StepResult;

/// Records written before outputs existed (no output field); still read.
const RECORD_FORMAT_V1: u8 = 1;
/// The current record: format 1's fields, then the output. (2 is the
/// in-flight record's format, `outside::IN_FLIGHT_FORMAT`.)
const RECORD_FORMAT: u8 = 3;

pub(super) fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

pub(super) fn take<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8], String> {
    if b.len() < n {
        return Err(format!("truncated: {} bytes left, {n} needed", b.len()));
    }
    let (head, rest) = b.split_at(n);
    *b = rest;
    Ok(head)
}

pub(super) fn take_u64(b: &mut &[u8]) -> Result<u64, String> {
    Ok(u64::from_be_bytes(take(b, 8)?.try_into().expect("8 bytes")))
}

pub(super) fn take_str(b: &mut &[u8]) -> Result<String, String> {
    let n = u32::from_be_bytes(take(b, 4)?.try_into().expect("4 bytes")) as usize;
    String::from_utf8(take(b, n)?.to_vec()).map_err(|e| e.to_string())
}

impl StepRecord {
    /// `format, kind, outcome, at_ms, saga_id (8 bytes BE each), step (4
    /// bytes BE)`, then the strings reason, resource version, downstream
    /// operation id, residual, action and fingerprint, and the byte string
    /// output, each as a 4-byte BE length and its bytes. (Format 1, still
    /// read, has no output.)
    pub fn encode(&self) -> Vec<u8> {
        let (outcome, reason, version, downstream, residual, output): (u8, &str, &str, &str, &str, &[u8]) =
            match &self.result {
                StepResult::Ok {
                    resource_version,
                    downstream_operation_id,
                    residual,
                    output,
                } => (1, "", resource_version, downstream_operation_id, residual, output),
                StepResult::Failed { reason } => (2, reason, "", "", "", &[]),
                StepResult::Noop { reason } => (3, reason, "", "", "", &[]),
                StepResult::Stale { reason, residual } => (4, reason, "", "", residual, &[]),
                StepResult::Pending {
                    note,
                    downstream_operation_id,
                } => (5, note, "", downstream_operation_id, "", &[]),
            };
        let mut out = vec![
            RECORD_FORMAT,
            match self.kind {
                CallKind::Forward => 1,
                CallKind::Compensate => 2,
            },
            outcome,
        ];
        out.extend_from_slice(&self.at_ms.to_be_bytes());
        out.extend_from_slice(&self.saga_id.to_be_bytes());
        out.extend_from_slice(&self.step.to_be_bytes());
        for s in [reason, version, downstream, residual, &self.action, &self.fingerprint] {
            put_str(&mut out, s);
        }
        out.extend_from_slice(&(output.len() as u32).to_be_bytes());
        out.extend_from_slice(output);
        out
    }

    pub fn decode(mut b: &[u8]) -> Result<StepRecord, String> {
        let b = &mut b;
        let head = take(b, 3)?;
        let format = head[0];
        if format != RECORD_FORMAT && format != RECORD_FORMAT_V1 {
            return Err(format!("unknown record format {format}"));
        }
        let kind = match head[1] {
            1 => CallKind::Forward,
            2 => CallKind::Compensate,
            k => return Err(format!("unknown call kind {k}")),
        };
        let at_ms = take_u64(b)?;
        let saga_id = take_u64(b)?;
        let step = u32::from_be_bytes(take(b, 4)?.try_into().expect("4 bytes"));
        let reason = take_str(b)?;
        let resource_version = take_str(b)?;
        let downstream_operation_id = take_str(b)?;
        let residual = take_str(b)?;
        let action = take_str(b)?;
        let fingerprint = take_str(b)?;
        let output = if format == RECORD_FORMAT {
            let n = u32::from_be_bytes(take(b, 4)?.try_into().expect("4 bytes")) as usize;
            take(b, n)?.to_vec()
        } else {
            Vec::new()
        };
        let result = match head[2] {
            1 => StepResult::Ok {
                resource_version,
                downstream_operation_id,
                residual,
                output,
            },
            2 => StepResult::Failed { reason },
            3 => StepResult::Noop { reason },
            4 => StepResult::Stale { reason, residual },
            5 => StepResult::Pending {
                note: reason,
                downstream_operation_id,
            },
            o => return Err(format!("unknown outcome {o}")),
        };
        Ok(StepRecord {
            kind,
            result,
            at_ms,
            saga_id,
            step,
            action,
            fingerprint,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        for result in [
            StepResult::Ok {
                resource_version: "3".into(),
                downstream_operation_id: "inv-9".into(),
                residual: "r".into(),
                output: b"reservation r-7".to_vec(),
            },
            StepResult::pending("waiting for the approver"),
            StepResult::failed("out of stock"),
            StepResult::noop("never happened"),
            StepResult::Stale {
                reason: "moved".into(),
                residual: "kept".into(),
            },
        ] {
            let rec = StepRecord {
                kind: CallKind::Compensate,
                result: result.clone(),
                at_ms: 17,
                saga_id: 5,
                step: 2,
                action: "release".into(),
                fingerprint: "ab".into(),
            };
            assert_eq!(StepRecord::decode(&rec.encode()), Ok(rec));
            assert_eq!(StepResult::from_reply(&result.to_reply()), Some(result));
        }
        assert!(StepRecord::decode(&[9, 1, 1]).is_err());
        assert!(StepRecord::decode(&[RECORD_FORMAT, 1]).is_err());
    }

    #[test]
    fn records_of_the_format_before_outputs_are_still_read() {
        let rec = StepRecord {
            kind: CallKind::Forward,
            result: StepResult::ok("4"),
            at_ms: 17,
            saga_id: 5,
            step: 2,
            action: "reserve".into(),
            fingerprint: "ab".into(),
        };
        let mut old = rec.encode();
        old[0] = RECORD_FORMAT_V1;
        old.truncate(old.len() - 4); // no output field
        assert_eq!(StepRecord::decode(&old), Ok(rec));
    }
}
