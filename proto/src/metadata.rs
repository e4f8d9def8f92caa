//! gRPC metadata keys of the wire contract and their readers. Every key a
//! node, a client or a participant sets or reads is named here once.

use tonic::Status;

/// gRPC metadata key that carries a transaction id from a client to the
/// services it calls, so a service can do its work under that transaction
/// and enlist itself (see `dtx_client::enlist`).
pub const TXID_METADATA_KEY: &str = "x-dtx-txid";

/// Puts `txid` into a request's metadata.
pub fn attach_txid<T>(req: &mut tonic::Request<T>, txid: u64) {
    req.metadata_mut().insert(TXID_METADATA_KEY, txid.into());
}

/// The transaction id a request carries, if any (and if well-formed).
pub fn txid_of<T>(req: &tonic::Request<T>) -> Option<u64> {
    req.metadata()
        .get(TXID_METADATA_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse().ok())
}

/// gRPC metadata key that carries, beside `x-dtx-txid`, the cluster
/// incarnation that handed the txid out (`BeginResponse.incarnation`): a
/// branch that prepares where it runs keeps its work under (incarnation,
/// txid), the name the cluster's phase-two messages will use.
pub const INCARNATION_METADATA_KEY: &str = "x-dtx-incarnation";

/// Puts `incarnation` into a request's metadata.
pub fn attach_incarnation<T>(req: &mut tonic::Request<T>, incarnation: u64) {
    req.metadata_mut().insert(INCARNATION_METADATA_KEY, incarnation.into());
}

/// The incarnation a request carries, if any (and if well-formed).
pub fn incarnation_of<T>(req: &tonic::Request<T>) -> Option<u64> {
    req.metadata()
        .get(INCARNATION_METADATA_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse().ok())
}

/// On a refusal by a follower: the id of the leader it knows.
pub const LEADER_ID_HEADER: &str = "x-dtx-leader-id";
/// On a refusal by a follower, and on an answer a follower forwarded from
/// the leader: the leader's API address.
pub const LEADER_ADDR_HEADER: &str = "x-dtx-leader-addr";
/// Set by a node on a call it forwards to the leader (a forwarded call is
/// never forwarded again).
pub const FORWARDED_HEADER: &str = "x-dtx-forwarded";
/// Set on a refusal that happened before anything was proposed: the call
/// certainly had no effect (a client may report it as a plain failure).
pub const NOT_APPLIED_HEADER: &str = "x-dtx-not-applied";
/// On every Raft transport call: the cluster id of the sender.
pub const CLUSTER_ID_HEADER: &str = "x-dtx-cluster-id";
/// On every Raft transport call: the node id of the sender.
pub const FROM_NODE_HEADER: &str = "x-dtx-from-node";

/// True when the status says the call certainly had no effect.
pub fn not_applied(status: &Status) -> bool {
    status.metadata().get(NOT_APPLIED_HEADER).is_some()
}

/// The leader's API address a refusal names, if any.
pub fn leader_hint(status: &Status) -> Option<String> {
    leader_addr_in(status.metadata())
}

/// The leader's API address `md` names (a refusal's, or a forwarded
/// answer's), if any.
pub fn leader_addr_in(md: &tonic::metadata::MetadataMap) -> Option<String> {
    md.get(LEADER_ADDR_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// On a participant's refusal of a coordinator message (FAILED_PRECONDITION):
/// what kind of refusal it is (`RefusalKind::as_str`). The status message
/// says the same for humans; programs read this key, never the text.
pub const REFUSAL_HEADER: &str = "x-dtx-refusal";

/// Why a participant refused a Prepare, Commit, Abort or CommitOnePhase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RefusalKind {
    /// The message's term is older than one the participant already saw for
    /// the transaction: a newer leader exists (fencing, invariant 9), not a
    /// protocol error.
    StaleTerm,
    /// Protocol violation: Commit for a transaction never prepared there.
    CommitWithoutPrepare,
    /// Protocol violation: Commit after a NO vote, an Abort or a tombstone.
    CommitAfterAbort,
    /// Protocol violation: Abort after the Commit was applied.
    AbortAfterCommit,
}

impl RefusalKind {
    /// Every kind, for tests and documentation.
    pub const ALL: [RefusalKind; 4] = [
        RefusalKind::StaleTerm,
        RefusalKind::CommitWithoutPrepare,
        RefusalKind::CommitAfterAbort,
        RefusalKind::AbortAfterCommit,
    ];

    /// The value carried under `REFUSAL_HEADER`.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalKind::StaleTerm => "stale-term",
            RefusalKind::CommitWithoutPrepare => "commit-without-prepare",
            RefusalKind::CommitAfterAbort => "commit-after-abort",
            RefusalKind::AbortAfterCommit => "abort-after-commit",
        }
    }

    /// The kind `as_str` names; `None` for any other value (a kind this
    /// build does not know).
    pub fn parse(s: &str) -> Option<RefusalKind> {
        RefusalKind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// Marks `status` as a refusal of `kind`.
pub fn set_refusal(status: &mut Status, kind: RefusalKind) {
    status.metadata_mut().insert(
        REFUSAL_HEADER,
        tonic::metadata::MetadataValue::from_static(kind.as_str()),
    );
}

/// The kind of refusal `status` carries, if it names one this build knows.
pub fn refusal(status: &Status) -> Option<RefusalKind> {
    status
        .metadata()
        .get(REFUSAL_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(RefusalKind::parse)
}

/// On a refusal of `RegisterBranch` (FAILED_PRECONDITION): what kind of
/// refusal it is (`BranchRefusalKind::as_str`). Programs read this key,
/// never the text.
pub const BRANCH_REFUSAL_HEADER: &str = "x-dtx-branch-refusal";

/// Why the cluster refused a branch's registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BranchRefusalKind {
    /// The transaction is PREPARING, decided, forgotten or past its
    /// deadline: the participant set is frozen without the branch, which
    /// must roll its prepared work back.
    TooLate,
    /// The branch was fenced out of the transaction (its decision was
    /// asked before it registered): it must roll its prepared work back.
    Fenced,
    /// The branch registered before with another vote, or another
    /// address: the recorded registration stands.
    Conflict,
}

impl BranchRefusalKind {
    /// Every kind, for tests and documentation.
    pub const ALL: [BranchRefusalKind; 3] = [
        BranchRefusalKind::TooLate,
        BranchRefusalKind::Fenced,
        BranchRefusalKind::Conflict,
    ];

    /// The value carried under `BRANCH_REFUSAL_HEADER`.
    pub fn as_str(self) -> &'static str {
        match self {
            BranchRefusalKind::TooLate => "too-late",
            BranchRefusalKind::Fenced => "fenced",
            BranchRefusalKind::Conflict => "conflict",
        }
    }

    /// The kind `as_str` names; `None` for any other value.
    pub fn parse(s: &str) -> Option<BranchRefusalKind> {
        BranchRefusalKind::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// True when the branch is certainly not a member and must roll its
    /// prepared work back.
    pub fn must_roll_back(self) -> bool {
        matches!(self, BranchRefusalKind::TooLate | BranchRefusalKind::Fenced)
    }
}

/// Marks `status` as a branch refusal of `kind`.
pub fn set_branch_refusal(status: &mut Status, kind: BranchRefusalKind) {
    status.metadata_mut().insert(
        BRANCH_REFUSAL_HEADER,
        tonic::metadata::MetadataValue::from_static(kind.as_str()),
    );
}

/// The kind of branch refusal `status` carries, if it names one this build
/// knows.
pub fn branch_refusal(status: &Status) -> Option<BranchRefusalKind> {
    status
        .metadata()
        .get(BRANCH_REFUSAL_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(BranchRefusalKind::parse)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_kinds_round_trip_through_their_names_and_the_metadata() {
        let names: Vec<&str> = RefusalKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "stale-term",
                "commit-without-prepare",
                "commit-after-abort",
                "abort-after-commit"
            ],
            "the names are part of the wire contract"
        );
        for kind in RefusalKind::ALL {
            assert_eq!(RefusalKind::parse(kind.as_str()), Some(kind));
            let mut s = Status::failed_precondition("any text at all");
            set_refusal(&mut s, kind);
            assert_eq!(refusal(&s), Some(kind));
            assert_eq!(s.message(), "any text at all", "the text stays for humans");
        }
    }

    #[test]
    fn branch_refusal_kinds_round_trip_and_only_the_header_counts() {
        let names: Vec<&str> = BranchRefusalKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            ["too-late", "fenced", "conflict"],
            "the names are part of the wire contract"
        );
        for kind in BranchRefusalKind::ALL {
            let mut s = Status::failed_precondition("text");
            set_branch_refusal(&mut s, kind);
            assert_eq!(branch_refusal(&s), Some(kind));
            assert_eq!(refusal(&s), None, "not a participant refusal");
        }
        assert!(BranchRefusalKind::TooLate.must_roll_back());
        assert!(BranchRefusalKind::Fenced.must_roll_back());
        assert!(!BranchRefusalKind::Conflict.must_roll_back());
        assert_eq!(branch_refusal(&Status::failed_precondition("too-late")), None);
    }

    #[test]
    fn refusal_is_read_from_the_metadata_never_from_the_text() {
        // The stale-term text without the key is no refusal kind.
        let s = Status::failed_precondition("message from term 3 is older than term 4 already seen");
        assert_eq!(refusal(&s), None);
        // An unknown or malformed value is no kind either.
        for v in ["", "Stale-Term", "stale_term", "stale-term "] {
            assert_eq!(RefusalKind::parse(v), None, "{v:?}");
        }
        let mut s = Status::failed_precondition("x");
        s.metadata_mut().insert(
            REFUSAL_HEADER,
            tonic::metadata::MetadataValue::from_static("newer-kind"),
        );
        assert_eq!(refusal(&s), None);
    }
}
