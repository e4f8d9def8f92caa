//! What a participant's answer to one call means for the driver: a
//! Prepare's vote, a delivery's failure sorted by code and refusal kind
//! (never by text), and the cutting of texts to their limits. A leaf: the
//! pure book and the async shell both use it.

use dtx_proto::metadata::RefusalKind;
use dtx_proto::v1 as pb;

use crate::sm::tally::Vote;

/// Cuts `s` to at most `max` bytes on a character boundary.
pub(crate) fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
}

/// Why one delivery call did not end in an ack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum DeliveryError {
    /// No answer (no connection, a timeout, a transport failure) or the
    /// participant failed as a whole (INTERNAL, e.g. its disk is full):
    /// about the participant, shared by every delivery to it.
    NoAnswer(String),
    /// The participant answered and refused this message: about this
    /// transaction only. `stale_term`: it has seen a newer leader's term
    /// (fencing at work, invariant 9), not a protocol error.
    Refused { message: String, stale_term: bool },
}

impl DeliveryError {
    /// Sorts a participant's error answer by its code, and a refusal by the
    /// kind it carries in its metadata (`x-dtx-refusal`), never by its text.
    pub(super) fn from_status(s: &tonic::Status) -> DeliveryError {
        use tonic::Code;
        let message = format!("{}: {}", s.code(), s.message());
        match s.code() {
            Code::FailedPrecondition
            | Code::InvalidArgument
            | Code::NotFound
            | Code::AlreadyExists
            | Code::OutOfRange => DeliveryError::Refused {
                stale_term: dtx_proto::metadata::refusal(s) == Some(RefusalKind::StaleTerm),
                message,
            },
            _ => DeliveryError::NoAnswer(message),
        }
    }

    /// One ApplyDecisions item's result as the attempt's: what the single
    /// call's answer would have meant (its code and refusal kind, sorted
    /// by `from_status`, never by the text).
    pub(super) fn of_item(r: pb::DecisionItemResult) -> Result<(), DeliveryError> {
        if r.applied {
            return Ok(());
        }
        let code = tonic::Code::from_i32(r.code);
        if code == tonic::Code::Ok {
            return Err(DeliveryError::Refused {
                message: "participant answered applied = false".into(),
                stale_term: false,
            });
        }
        let mut s = tonic::Status::new(code, r.message);
        if let Some(kind) = RefusalKind::parse(&r.refusal) {
            dtx_proto::metadata::set_refusal(&mut s, kind);
        }
        Err(DeliveryError::from_status(&s))
    }
}

/// What a Prepare call's answer means as a vote (anything but a vote counts
/// as no vote).
pub(super) fn vote_of(vote: i32, reason: String) -> Vote {
    match pb::Vote::try_from(vote) {
        Ok(pb::Vote::Yes) => Vote::Yes,
        Ok(pb::Vote::ReadOnly) => Vote::ReadOnly,
        Ok(pb::Vote::No) => Vote::No(reason),
        _ => Vote::Failed(format!("malformed vote value {vote}")),
    }
}

#[cfg(test)]
mod tests {
    use dtx_proto::metadata::set_refusal;
    use dtx_proto::metadata::RefusalKind;
    use tonic::Code;
    use tonic::Status;

    use super::DeliveryError;

    /// The text the participant SDK puts on a stale-term refusal.
    const STALE_TEXT: &str = "message from term 3 is older than term 4 already seen for this transaction";

    fn status(code: Code, text: &str, kind: Option<RefusalKind>) -> Status {
        let mut s = Status::new(code, text);
        if let Some(k) = kind {
            set_refusal(&mut s, k);
        }
        s
    }

    fn refused(code: Code, text: &str, stale_term: bool) -> DeliveryError {
        DeliveryError::Refused {
            message: format!("{code}: {text}"),
            stale_term,
        }
    }

    /// Invariant 9: a participant that saw a newer leader's term refuses
    /// this leader's message; that is fencing at work, not a protocol
    /// error. The driver knows it by the kind the SDK puts in the metadata
    /// (`x-dtx-refusal`), never by the message text.
    #[test]
    fn inv9_a_stale_term_refusal_is_known_by_its_metadata_not_its_text() {
        let fp = Code::FailedPrecondition;
        assert_eq!(
            DeliveryError::from_status(&status(fp, STALE_TEXT, Some(RefusalKind::StaleTerm))),
            refused(fp, STALE_TEXT, true)
        );
        assert_eq!(
            DeliveryError::from_status(&status(fp, "reworded", Some(RefusalKind::StaleTerm))),
            refused(fp, "reworded", true),
            "the text may change"
        );
        assert_eq!(
            DeliveryError::from_status(&status(fp, STALE_TEXT, None)),
            refused(fp, STALE_TEXT, false),
            "the text alone is not read"
        );
    }

    #[test]
    fn protocol_refusals_are_refused_and_not_stale() {
        for kind in [
            RefusalKind::CommitWithoutPrepare,
            RefusalKind::CommitAfterAbort,
            RefusalKind::AbortAfterCommit,
        ] {
            assert_eq!(
                DeliveryError::from_status(&status(Code::FailedPrecondition, "violation", Some(kind))),
                refused(Code::FailedPrecondition, "violation", false),
                "{kind:?}"
            );
        }
        for code in [
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::OutOfRange,
        ] {
            assert_eq!(
                DeliveryError::from_status(&status(code, "no", None)),
                refused(code, "no", false),
                "{code:?}"
            );
        }
    }

    /// An answer about the participant as a whole (down, disk full, an
    /// internal failure) is no refusal of this message, whatever it
    /// carries: it goes to the participant's shared health record.
    #[test]
    fn failures_of_the_participant_are_no_answer() {
        for code in [
            Code::Unavailable,
            Code::ResourceExhausted,
            Code::Internal,
            Code::DeadlineExceeded,
            Code::Unknown,
            Code::Cancelled,
        ] {
            assert_eq!(
                DeliveryError::from_status(&status(code, STALE_TEXT, Some(RefusalKind::StaleTerm))),
                DeliveryError::NoAnswer(format!("{code}: {STALE_TEXT}")),
                "{code:?}"
            );
        }
    }
}
