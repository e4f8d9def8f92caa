//! The byte encoding of inbox records ([`StepRecord::encode`] and
//! [`StepRecord::decode`]), and the length-prefixed fields the in-flight
//! records of outside calls are made of too.

use super::types::CallKind;
use super::types::StepRecord;
use super::types::StepResult;

const RECORD_FORMAT: u8 = 1;

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
    /// operation id, residual, action and fingerprint, each as a 4-byte BE
    /// length and its UTF-8 bytes.
    pub fn encode(&self) -> Vec<u8> {
        let (outcome, reason, version, downstream, residual): (u8, &str, &str, &str, &str) = match &self.result {
            StepResult::Ok {
                resource_version,
                downstream_operation_id,
                residual,
            } => (1, "", resource_version, downstream_operation_id, residual),
            StepResult::Failed { reason } => (2, reason, "", "", ""),
            StepResult::Noop { reason } => (3, reason, "", "", ""),
            StepResult::Stale { reason, residual } => (4, reason, "", "", residual),
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
        out
    }

    pub fn decode(mut b: &[u8]) -> Result<StepRecord, String> {
        let b = &mut b;
        let head = take(b, 3)?;
        if head[0] != RECORD_FORMAT {
            return Err(format!("unknown record format {}", head[0]));
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
        let result = match head[2] {
            1 => StepResult::Ok {
                resource_version,
                downstream_operation_id,
                residual,
            },
            2 => StepResult::Failed { reason },
            3 => StepResult::Noop { reason },
            4 => StepResult::Stale { reason, residual },
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
            },
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
}
