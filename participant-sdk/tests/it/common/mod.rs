//! Shared by the test modules: the store comparisons of the grouped-message
//! tests (t40, t41) here, and the stand-in outside system of the saga step
//! tests (t61, t62) in `outside`.

pub mod outside;

use dtx_proto::v1 as pb;
use participant_sdk::store::ParticipantStore;
use participant_sdk::store::Resource;

/// Two stores that were sent the same work, one message at a time and in
/// groups, hold the same log, the same resource data and the same in-doubt
/// index.
pub fn assert_stores_agree<R: Resource>(a: &ParticipantStore<R>, b: &ParticipantStore<R>, what: &str) {
    assert_eq!(a.entries().unwrap(), b.entries().unwrap(), "{what}: the log");
    assert_eq!(
        a.view().scan(b"").unwrap(),
        b.view().scan(b"").unwrap(),
        "{what}: the data"
    );
    assert_eq!(
        a.in_doubt().unwrap(),
        b.in_doubt().unwrap(),
        "{what}: the in-doubt index"
    );
}

/// One decision for `txid` as the leader sends it in `ApplyDecisions` or
/// riding in `PrepareMany`.
pub fn decision_item(txid: u64, participant_id: &str, outcome: pb::DecisionOutcome, term: u64) -> pb::DecisionItem {
    pb::DecisionItem {
        txid,
        term,
        participant_id: participant_id.into(),
        outcome: outcome as i32,
        incarnation: 0,
    }
}
