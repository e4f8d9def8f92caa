//! Cluster incarnations (docs/adr/0033-cluster-incarnations.md): which
//! cluster handed out a txid or a saga id, so that a participant never
//! takes one cluster's transaction for another's.
//!
//! Txids are numbers that only grow inside one cluster's history
//! (invariant 10), but two clusters that share a participant, or a cluster
//! and the cluster restored from its backup, count through the same
//! numbers. So every cluster has an incarnation: a random nonzero id that
//! its first leader chooses (`Command::OpenIncarnation`), and that a
//! restore ends (`Incarnations::close`), so the restored cluster's first
//! leader chooses a new one. Every id handed out belongs to the
//! incarnation that was open when it was handed out; participants key
//! their records by (incarnation, txid), and a decision read names the
//! incarnation the participant received.
//!
//! The history is a list of eras, each the first txid and saga id handed
//! out in one incarnation. Ids below the first era belong to incarnation
//! 0: handed out before this cluster chose one (by a version before
//! incarnations). After a restore the last era ends at the backup's next
//! ids: what the old cluster handed out after that is unknown here, and a
//! read of it in the old incarnation is answered "another incarnation",
//! never "presumed abort".
//!
//! Pure: no clock, no randomness (the proposing leader draws the id).

use serde::Deserialize;
use serde::Serialize;

use super::saga::SagaId;
use super::Txid;

/// One incarnation's part of the history: from these ids on, until the
/// next era (or the end, `Incarnations::closed_at`), ids are its own.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Era {
    pub incarnation: u64,
    pub first_txid: Txid,
    pub first_saga_id: SagaId,
}

/// The replicated history of incarnations (part of the state machine, its
/// snapshots and backups).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct Incarnations {
    /// Oldest first; first ids strictly growing.
    eras: Vec<Era>,
    /// Set by a restore: the last era ended at these next ids (the
    /// backup's), and no incarnation is open until a leader opens one.
    closed_at: Option<(Txid, SagaId)>,
}

/// What a reader asked about, with the incarnation it named, is to this
/// cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Belonging {
    /// Asked without an incarnation (0, an SDK from before them), or with
    /// the one that handed the id out here: answer from the table.
    Ours,
    /// Another incarnation handed it out (another cluster, or the old
    /// cluster after the backup this one was restored from): nothing is
    /// known or presumed here.
    Other,
}

impl Incarnations {
    /// The incarnation ids are handed out in now; `None` before a leader
    /// opened one (a new cluster, one from before incarnations, or a
    /// restored one).
    pub fn current(&self) -> Option<u64> {
        match (self.closed_at, self.eras.last()) {
            (None, Some(e)) => Some(e.incarnation),
            _ => None,
        }
    }

    pub fn eras(&self) -> &[Era] {
        &self.eras
    }

    /// The incarnation that handed out `txid` here, `None` when this
    /// cluster cannot know (at or past where a restore ended the last
    /// era, before a new one began). 0 for ids from before the first era.
    pub fn of_txid(&self, txid: Txid) -> Option<u64> {
        self.of(txid, |e| e.first_txid, self.closed_at.map(|c| c.0))
    }

    /// As `of_txid`, for saga ids.
    pub fn of_saga(&self, saga_id: SagaId) -> Option<u64> {
        self.of(saga_id, |e| e.first_saga_id, self.closed_at.map(|c| c.1))
    }

    fn of(&self, id: u64, first: impl Fn(&Era) -> u64, closed_at: Option<u64>) -> Option<u64> {
        if closed_at.is_some_and(|end| id >= end) {
            return None;
        }
        Some(
            self.eras
                .iter()
                .rev()
                .find(|e| first(e) <= id)
                .map(|e| e.incarnation)
                .unwrap_or(0),
        )
    }

    /// Whether `txid`, asked about with `incarnation`, is this cluster's.
    pub fn belonging(&self, incarnation: u64, txid: Txid) -> Belonging {
        if incarnation == 0 || self.of_txid(txid) == Some(incarnation) {
            Belonging::Ours
        } else {
            Belonging::Other
        }
    }

    /// Opens `incarnation` from the next ids on (`Command::OpenIncarnation`).
    /// `Ok(false)` when one is open already (a second leader's attempt, or
    /// a repeat: the first stays). Refused: 0, or an incarnation this
    /// history already holds (ids would no longer name one cluster).
    pub fn open(&mut self, incarnation: u64, next_txid: Txid, next_saga_id: SagaId) -> Result<bool, String> {
        if self.current().is_some() {
            return Ok(false);
        }
        if incarnation == 0 {
            return Err("incarnation 0 means \"before incarnations\" and cannot be opened".into());
        }
        if self.eras.iter().any(|e| e.incarnation == incarnation) {
            return Err(format!(
                "incarnation {incarnation:016x} was open in this cluster's history before; a new one must be new"
            ));
        }
        if let Some(last) = self.eras.last() {
            // Ids only grow (invariant 10), so eras never overlap.
            debug_assert!(last.first_txid <= next_txid && last.first_saga_id <= next_saga_id);
        }
        self.eras.push(Era {
            incarnation,
            first_txid: next_txid,
            first_saga_id: next_saga_id,
        });
        self.closed_at = None;
        Ok(true)
    }

    /// Ends the open incarnation at these next ids (a restore: the backup
    /// was taken there, and the old cluster may have gone on from them).
    pub fn close(&mut self, next_txid: Txid, next_saga_id: SagaId) {
        if self.closed_at.is_none() {
            self.closed_at = Some((next_txid, next_saga_id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_before_the_first_era_are_incarnation_zero_and_answered_as_before() {
        let mut h = Incarnations::default();
        assert_eq!(h.current(), None);
        assert_eq!(h.of_txid(5), Some(0));
        assert!(h.open(0xa, 10, 3).unwrap());
        assert_eq!(h.current(), Some(0xa));
        assert_eq!(h.of_txid(9), Some(0));
        assert_eq!(h.of_txid(10), Some(0xa));
        assert_eq!(h.of_saga(2), Some(0));
        assert_eq!(h.of_saga(3), Some(0xa));
        assert_eq!(h.belonging(0, 9), Belonging::Ours);
        assert_eq!(
            h.belonging(0, 12),
            Belonging::Ours,
            "an SDK from before incarnations asks with 0"
        );
        assert_eq!(h.belonging(0xa, 12), Belonging::Ours);
        assert_eq!(
            h.belonging(0xb, 12),
            Belonging::Other,
            "invariant 10: another cluster's txid 12"
        );
        assert_eq!(
            h.belonging(0xa, 9),
            Belonging::Other,
            "txid 9 was handed out before 0xa"
        );
    }

    #[test]
    fn inv10_a_restore_ends_the_era_and_the_old_clusters_later_ids_are_not_ours() {
        let mut h = Incarnations::default();
        h.open(0xa, 1, 1).unwrap();
        // The backup was taken at next txid 782; the old cluster went on.
        h.close(782, 40);
        assert_eq!(
            h.current(),
            None,
            "a restored cluster hands out nothing before a new incarnation"
        );
        assert_eq!(h.of_txid(781), Some(0xa));
        assert_eq!(h.of_txid(800), None);
        assert_eq!(
            h.belonging(0xa, 781),
            Belonging::Ours,
            "in the backup: answered from the table"
        );
        assert_eq!(
            h.belonging(0xa, 800),
            Belonging::Other,
            "handed out by the old cluster after the backup: never presumed aborted here"
        );
        assert_eq!(h.of_saga(40), None);
        assert!(h.open(0xb, 782, 40).unwrap());
        assert_eq!(h.current(), Some(0xb));
        assert_eq!(h.of_txid(782), Some(0xb));
        assert_eq!(h.belonging(0xa, 800), Belonging::Other);
        assert_eq!(h.belonging(0xb, 800), Belonging::Ours);
        assert_eq!(h.of_saga(41), Some(0xb));
    }

    #[test]
    fn an_open_incarnation_stays_and_an_old_or_zero_one_is_refused() {
        let mut h = Incarnations::default();
        assert!(h.open(0xa, 1, 1).unwrap());
        assert!(!h.open(0xc, 5, 1).unwrap(), "the first open stays");
        assert_eq!(h.current(), Some(0xa));
        h.close(9, 1);
        assert!(
            h.open(0xa, 9, 1).is_err(),
            "an incarnation of the history is never reopened"
        );
        assert!(h.open(0, 9, 1).is_err());
        assert_eq!(h.current(), None);
        // A second close keeps where the first ended the era.
        h.close(20, 2);
        assert_eq!(h.of_txid(10), None);
    }
}
