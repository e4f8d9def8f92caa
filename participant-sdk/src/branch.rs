//! Branches that prepare where they run, on the SDK's own store
//! (docs/protocol.md, "Branches"; docs/adr/0046).
//!
//! A service called inside a transaction (its txid and incarnation in the
//! call's metadata, [`dtx_client::propagate`]) does the work in its own
//! handler and joins the transaction with its vote in one call:
//! [`join`] runs the resource's `prepare` on the handler's input, writes
//! the vote durably (a YES with a mark "not registered yet"), registers it
//! with the cluster ([`dtx_client::Client::register_branch`]), and only
//! then returns, so the handler answers its caller after the cluster has
//! the vote. The coordinator sends such a branch no Prepare at commit; its
//! Commit or Abort arrives as any participant's.
//!
//! Each way it can end:
//! - registered: the branch is a member; the decision comes in phase two
//!   (or from recovery, as for any in-doubt vote);
//! - refused (the transaction is PREPARING, decided, forgotten or past its
//!   deadline, or the branch was fenced out): the prepared work is rolled
//!   back here before this returns ([`BranchError::RolledBack`]);
//! - no definite answer: the work stays prepared and marked, and
//!   recovery asks the cluster by (txid, participant): a member follows
//!   the decision; a branch that is not one is fenced out and rolls back,
//!   also when the transaction committed without it
//!   ([`BranchError::Unknown`]: the caller should abort).

use dtx_client::BranchVote;
use dtx_client::Client;
use dtx_client::ClientError;

use crate::log::GlobalTxid;
use crate::log::Message;
use crate::log::Vote;
use crate::participant::Reply;
use crate::participant::StoreError;
use crate::store::BranchPrepare;
use crate::store::ParticipantStore;
use crate::store::Resource;

/// Who the branch is: its participant id and where the cluster reaches
/// its `ParticipantService` for phase two.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BranchIdentity {
    /// The participant id (the same on every call of this service).
    pub participant_id: String,
    /// The address the cluster delivers decisions to.
    pub address: String,
}

/// A branch that joined: its vote is recorded in the transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Joined {
    /// The vote recorded: YES (work prepared, held until the decision),
    /// READ_ONLY (nothing to do), or NO (the work was refused, the
    /// transaction aborts).
    pub vote: Vote,
    /// The reason of a NO.
    pub reason: String,
    /// The term of the leader that recorded the registration.
    pub term: u64,
}

/// Why a branch did not join.
#[derive(Debug, thiserror::Error)]
pub enum BranchError {
    /// The cluster refused the registration, or certainly never recorded
    /// it: the prepared work was rolled back here. The caller's
    /// transaction cannot commit this work.
    #[error("transaction {txid}: the branch did not join and its work was rolled back: {why}")]
    RolledBack { txid: GlobalTxid, why: String },
    /// No definite answer from the cluster: the work stays prepared and
    /// recovery settles it. Answer the caller with an error; it should
    /// abort.
    #[error(
        "transaction {txid}: whether the branch's registration was recorded is not known ({why}); its prepared \
         work is left to recovery"
    )]
    Unknown { txid: GlobalTxid, why: String },
    /// The transaction already has a record here: a repeated call, or
    /// the same participant enlisted by its client as well. Nothing done.
    #[error("transaction {txid} already has a record here ({state}); a branch prepares once per transaction")]
    AlreadyPrepared { txid: GlobalTxid, state: String },
    /// The call carried no transaction id (or no incarnation).
    #[error("the call carries no {0}: a branch runs only inside a transaction (dtx_client::propagate::scope_in)")]
    NoTransaction(&'static str),
    /// The handler's SQL does what `PREPARE TRANSACTION` refuses (`what`:
    /// NOTIFY, LISTEN, UNLISTEN, a temporary table, a cursor WITH HOLD, an
    /// exported snapshot), so the branch could never vote YES; `why` says
    /// why and what to do instead. Refused before the statement reaches
    /// PostgreSQL, or found in the transaction before `PREPARE
    /// TRANSACTION` (docs/protocol.md, "Branches"). Nothing is prepared.
    #[error("{what} cannot be part of a branch's transaction: {why}")]
    Unpreparable { what: String, why: String },
    /// The participant's store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What a handler answers its caller when its branch did not join (the
/// table of docs/writing-a-service.md): INVALID_ARGUMENT without a
/// transaction, ABORTED when rolled back, ALREADY_EXISTS, UNKNOWN (the
/// caller should abort), FAILED_PRECONDITION for SQL a branch cannot
/// prepare (as for a NO), UNAVAILABLE when the store's server cannot be
/// reached now, INTERNAL for any other store failure.
impl From<BranchError> for tonic::Status {
    fn from(e: BranchError) -> tonic::Status {
        let text = e.to_string();
        match e {
            BranchError::NoTransaction(_) => tonic::Status::invalid_argument(text),
            BranchError::RolledBack { .. } => tonic::Status::aborted(text),
            BranchError::AlreadyPrepared { .. } => tonic::Status::already_exists(text),
            BranchError::Unknown { .. } => tonic::Status::unknown(text),
            BranchError::Unpreparable { .. } => tonic::Status::failed_precondition(text),
            BranchError::Store(StoreError::Unavailable(_)) => tonic::Status::unavailable(text),
            BranchError::Store(_) => tonic::Status::internal(text),
        }
    }
}

/// The transaction the handler serving `req` runs in: its txid and
/// incarnation, from the metadata `dtx_client::propagate` carries.
pub fn transaction_of<T>(req: &tonic::Request<T>) -> Result<GlobalTxid, BranchError> {
    let txid = dtx_client::propagate::request_txid(req).ok_or(BranchError::NoTransaction("x-dtx-txid"))?;
    let incarnation =
        dtx_client::propagate::request_incarnation(req).ok_or(BranchError::NoTransaction("x-dtx-incarnation"))?;
    Ok(GlobalTxid::new(incarnation, txid))
}

/// Runs the branch of `txid` on `store`: the resource prepares `payload`
/// (the handler's input), the vote is written durably, registered with
/// the cluster through `client`, and returned once the cluster has it.
/// See the module documentation for each way it ends.
pub async fn join<R: Resource>(
    store: &ParticipantStore<R>,
    client: &Client,
    who: &BranchIdentity,
    txid: GlobalTxid,
    payload: &[u8],
) -> Result<Joined, BranchError> {
    let answer = match store.prepare_branch(txid, &who.participant_id, payload).await? {
        BranchPrepare::Exists(e) => {
            return Err(BranchError::AlreadyPrepared {
                txid,
                state: format!("{:?}", e.state),
            })
        }
        BranchPrepare::Answered(a) => a,
    };
    let vote = match answer.reply {
        Reply::Vote(v) => v,
        Reply::Ack => return Err(StoreError::Io("a prepare answered with an ack".into()).into()),
    };
    // A caller that goes away (its future dropped: a client disconnect)
    // while the registration is in flight must not leave the branch
    // counted as running here for good: recovery would never settle it.
    let _flow = Flow { store, txid };
    if vote == Vote::Yes {
        dtx_failpoint::failpoint!("participant_branch_prepared_before_register");
    }
    let branch_vote = match vote {
        Vote::Yes => BranchVote::Yes,
        Vote::No => BranchVote::No,
        Vote::ReadOnly => BranchVote::ReadOnly,
    };
    let registered = client
        .register_branch(
            (txid.incarnation, txid.txid),
            &who.participant_id,
            &who.address,
            branch_vote,
            &answer.reason,
        )
        .await;
    // Only a YES holds prepared work and a mark.
    let held = vote == Vote::Yes;
    match registered {
        Ok(r) => {
            if held {
                store.finish_branch(txid, true)?;
                dtx_failpoint::failpoint!("participant_branch_registered_before_answer");
            }
            Ok(Joined {
                vote,
                reason: answer.reason,
                term: r.term,
            })
        }
        // Certainly not recorded, and never to be: roll back now.
        Err(e) if certainly_out(&e) => {
            if held {
                roll_back(store, txid).await?;
                store.finish_branch(txid, true)?;
            }
            Err(BranchError::RolledBack {
                txid,
                why: e.to_string(),
            })
        }
        Err(e) => {
            if held {
                store.finish_branch(txid, false)?;
            }
            Err(BranchError::Unknown {
                txid,
                why: e.to_string(),
            })
        }
    }
}

/// The flow of a branch in this process: when it ends however it ends
/// (its future dropped included), the branch is no longer running here,
/// so recovery may settle a mark left behind (`finish_branch` without
/// settling: it only forgets the running flow; settled endings have
/// already removed the mark).
struct Flow<'a, R: Resource> {
    store: &'a ParticipantStore<R>,
    txid: GlobalTxid,
}

impl<R: Resource> Drop for Flow<'_, R> {
    fn drop(&mut self) {
        let _ = self.store.finish_branch(self.txid, false);
    }
}

/// True when `e` says the registration is not recorded and cannot be
/// recorded later: a refusal that freezes the branch out, a txid never
/// begun, a request the cluster refused before anything ran, or one that
/// reached no node. A conflict with an earlier registration of this
/// participant, an unknown outcome or an internal error are not.
pub(crate) fn certainly_out(e: &ClientError) -> bool {
    match e {
        ClientError::BranchRefused { kind, .. } => kind.must_roll_back(),
        ClientError::NotFound(_)
        | ClientError::InvalidArgument(_)
        | ClientError::FailedPrecondition(_)
        | ClientError::PermissionDenied(_)
        | ClientError::Unauthenticated(_)
        | ClientError::Unimplemented(_)
        | ClientError::NotApplied(_)
        | ClientError::Unavailable(_) => true,
        ClientError::AlreadyExists(_) | ClientError::Unknown(_) | ClientError::Internal(_) => false,
    }
}

/// Rolls the prepared work of `txid` back through the log (an Abort in
/// the record's own term, so it is never refused as stale).
async fn roll_back<R: Resource>(store: &ParticipantStore<R>, txid: GlobalTxid) -> Result<(), StoreError> {
    let term = store.entry(txid)?.map(|e| e.term).unwrap_or(0);
    store.handle(txid, Message::Abort { term }, b"").await.map(|_| ())
}
