//! What the state machine holds in memory (`SmState`), and what readers
//! see of the transaction table through it: the records in memory and the
//! retained ones on disk alike (ADR 0050, `store::retained`).

use std::borrow::Cow;

use super::retained::RetainedReadError;
use super::retained::RetainedReader;
use crate::raft::LogId;
use crate::raft::StoredMembership;
use crate::sm::incarnation::Incarnations;
use crate::sm::operator::ListFilter;
use crate::sm::operator::ListPage;
use crate::sm::operator::StateFilter;
use crate::sm::saga::SagaBook;
use crate::sm::settlement::Settlements;
use crate::sm::RetainedRecord;
use crate::sm::TxRecord;
use crate::sm::TxTable;
use crate::sm::Txid;

/// Everything the state machine holds, in memory.
#[derive(Debug, Default)]
pub struct SmState {
    pub table: TxTable,
    /// Saga definitions and journals.
    pub sagas: SagaBook,
    pub last_applied: Option<LogId>,
    pub membership: StoredMembership,
    /// Which incarnation handed out which ids (ADR 0033).
    pub incarnations: Incarnations,
    /// Operators' settlements of other incarnations' txids (ADR 0040).
    pub settlements: Settlements,
    /// The decided, fully acked records kept on disk only (ADR 0050;
    /// `store::retained`): None in a state built without a store.
    pub retained: Option<RetainedReader>,
    /// How many records are retained.
    pub retained_count: u64,
}

impl SmState {
    /// A state of `table` alone, with nothing retained (tools, tests).
    pub fn of_table(table: TxTable) -> SmState {
        SmState {
            table,
            ..SmState::default()
        }
    }
}

/// A table holding only `r` (with `next_txid`): a retained record read by
/// the same code as one in memory.
fn table_of(next_txid: Txid, r: RetainedRecord) -> TxTable {
    let mut t = TxTable::from_parts(next_txid, []);
    t.admit(r);
    t
}

/// What readers see of the transaction table: the records in memory and
/// the retained ones, alike.
impl SmState {
    fn retained_record(&self, txid: Txid) -> Result<Option<RetainedRecord>, RetainedReadError> {
        match &self.retained {
            Some(r) if self.table.get(txid).is_none() => r.get(txid),
            _ => Ok(None),
        }
    }

    /// Runs `f` on a table that holds `txid`'s record if there is one, in
    /// memory or retained: every per-transaction read of `TxTable` works
    /// on the answer.
    pub fn with_txid<R>(&self, txid: Txid, f: impl FnOnce(&TxTable) -> R) -> Result<R, RetainedReadError> {
        match self.retained_record(txid)? {
            Some(r) => Ok(f(&table_of(self.table.next_txid(), r))),
            None => Ok(f(&self.table)),
        }
    }

    /// The record of `txid`, in memory or retained.
    pub fn record(&self, txid: Txid) -> Result<Option<Cow<'_, TxRecord>>, RetainedReadError> {
        if let Some(r) = self.table.get(txid) {
            return Ok(Some(Cow::Borrowed(r)));
        }
        Ok(self.retained_record(txid)?.map(|r| Cow::Owned(r.record)))
    }

    /// The owner of `txid` (`TxTable::owner`), in memory or retained.
    pub fn owner(&self, txid: Txid) -> Result<Option<String>, RetainedReadError> {
        self.with_txid(txid, |t| t.owner(txid).map(str::to_string))
    }

    /// The transaction an idempotency key belongs to, in memory or
    /// retained.
    pub fn txid_of_key(&self, key: &str) -> Result<Option<Txid>, RetainedReadError> {
        if let Some(t) = self.table.txid_of_key(key) {
            return Ok(Some(t));
        }
        match &self.retained {
            Some(r) => r.txid_of_key(key),
            None => Ok(None),
        }
    }

    /// Every txid with a record, in memory or retained, lowest first
    /// (tools that list them all).
    pub fn all_txids(&self) -> Result<Vec<Txid>, RetainedReadError> {
        let mut all: Vec<Txid> = self.table.txids_after(0).collect();
        if let Some(r) = &self.retained {
            all.extend(r.after(0, usize::MAX)?.into_iter().map(|r| r.record.txid));
        }
        all.sort_unstable();
        Ok(all)
    }

    /// How many transaction records there are, in memory and retained.
    pub fn transactions(&self) -> u64 {
        self.table.len() as u64 + self.retained_count
    }

    /// Decided, fully acked transactions decided at or before
    /// `decided_before_ms`, at most `max` (the forget loop's candidates):
    /// those in memory oldest first (`TxTable::forgettable`), then the
    /// retained ones by ascending txid (`RetainedReader::forgettable`).
    pub fn forgettable(&self, decided_before_ms: u64, max: usize) -> Result<Vec<Txid>, RetainedReadError> {
        let mut out = self.table.forgettable(decided_before_ms, max);
        if let Some(r) = &self.retained {
            let more = r.forgettable(decided_before_ms, max.saturating_sub(out.len()))?;
            out.extend(more);
        }
        Ok(out)
    }

    /// `TxTable::list` over the records in memory and the retained ones.
    /// A retained record is decided and fully acked, so the filters that
    /// name an index (unacknowledged, PREPARING) never meet one; nor does
    /// `dropped` (a dropped participant that never acked keeps the record
    /// in memory).
    pub fn list(
        &self,
        filter: &ListFilter,
        after: Txid,
        limit: usize,
        scan_max: usize,
    ) -> Result<ListPage, RetainedReadError> {
        let retained_never_meet = filter.dropped
            || filter.unacknowledged
            || matches!(filter.state, Some(StateFilter::Preparing) | Some(StateFilter::Active));
        let Some(reader) = self.retained.as_ref().filter(|_| !retained_never_meet) else {
            return Ok(self.table.list(filter, after, limit, scan_max));
        };
        let (limit, scan_max) = (limit.max(1), scan_max.max(1));
        // One more than can be looked at, so a page knows whether any follow.
        let retained = reader.after(after, scan_max + 1)?;
        let mut retained = retained.into_iter().peekable();
        let mut hot = self.table.txids_after(after).peekable();
        let mut page = ListPage::default();
        let mut scanned = 0usize;
        let mut last_seen = after;
        loop {
            let take_hot = match (hot.peek(), retained.peek()) {
                (None, None) => break,
                (Some(h), Some(r)) => *h < r.record.txid,
                (Some(_), None) => true,
                (None, Some(_)) => false,
            };
            if scanned >= scan_max || page.txids.len() >= limit {
                page.next_after = last_seen;
                break;
            }
            scanned += 1;
            let meets = if take_hot {
                let t = hot.next().expect("peeked");
                last_seen = t;
                self.table.meets(t, filter)
            } else {
                let r = retained.next().expect("peeked");
                let t = r.record.txid;
                last_seen = t;
                table_of(self.table.next_txid(), r).meets(t, filter)
            };
            if meets {
                page.txids.push(last_seen);
            }
        }
        Ok(page)
    }
}
