//! The participant SDK: what a service embeds to take part in dtx
//! transactions as a two-phase-commit participant.
//!
//! A participant service
//! 1. implements [`store::Resource`] for its data: `prepare` checks and
//!    stages the work a transaction's payload describes and votes (YES,
//!    READ_ONLY, or NO, with its reason through [`store::Staged::refuse`]),
//!    `commit` and `abort` finish it;
//! 2. opens a [`store::ParticipantStore`] on a directory of its own: the
//!    resource's data and the participant's log live there together;
//! 3. serves [`server::ParticipantServer`] (`dtx.v1.ParticipantService`,
//!    over any [`participant::Participant`], of which the store is one)
//!    at the address it is enlisted with, for the coordinator's Prepare,
//!    Commit, Abort, ApplyDecisions (many decisions in one message, applied
//!    in one write), CommitOnePhase and Inquire, and for operators Inspect
//!    (what its log holds: records by txid, the in-doubt ones, the most
//!    recent ones; read-only);
//! 4. runs recovery ([`server::spawn_recovery_with`]) against the
//!    coordinator cluster, which resolves transactions left in doubt and
//!    garbage-collects the log;
//! 5. exits when [`store::ParticipantStore::stopped`] says so, and is
//!    restarted by its supervisor.
//!
//! Its callers enlist it in their transactions
//! (`dtx_client::Client::enlist`), or it enlists itself from the txid
//! their calls carry (`dtx_client::enlist`, `dtx_client::propagate`).
//!
//! # What the SDK guarantees
//!
//! - **The log** ([`log`]) decides what each message does given what the
//!   participant already recorded: Prepare is idempotent, an Abort before
//!   the Prepare leaves a tombstone (a late Prepare then votes NO), Commit
//!   and Abort are applied exactly once, a message from an older leader
//!   term is refused (fencing; for a transaction without a record, a
//!   Prepare or CommitOnePhase below the durable term floor of its
//!   incarnation), and protocol violations (Commit without Prepare, Commit
//!   after Abort, Abort after Commit) are refused, never applied. A
//!   transaction is a [`GlobalTxid`]: the txid with the cluster incarnation
//!   that handed it out, so another cluster's (or a restored cluster's)
//!   same txid number is another transaction.
//! - **The store** ([`store`]) writes the resource's change and its log
//!   record in one atomic sled batch, and replies only after an fsync that
//!   covers it (shared by concurrent requests); the decisions of one
//!   `ApplyDecisions` message go into one batch and one fsync together,
//!   each item answered as its own Commit or Abort would be. Resource calls run one at a
//!   time, so a resource takes its locks without synchronization of its
//!   own. The in-doubt transactions (YES vote, no decision) are indexed in
//!   the same writes, so recovery never misses one; an index entry that is
//!   really inconsistent is logged, counted
//!   (`dtx_participant_log_inconsistencies_total`) and skipped, never taken
//!   as "nothing in doubt".
//! - **A store that cannot write stops.** sled refuses every write after a
//!   failed one (a full disk) until it is reopened, so at its first failed
//!   write or fsync the store refuses every request (a full disk as
//!   [`store::StoreError::Stopped`] with `is_disk_full()`,
//!   RESOURCE_EXHAUSTED "the disk is full" over gRPC), acknowledges nothing
//!   more, and [`store::ParticipantStore::stopped`] completes so the
//!   service can exit and be restarted on what is on disk. A start on a
//!   full disk says so and never leaves the directory unopenable.
//! - **Recovery** ([`server`]) asks the cluster for the decisions of the
//!   in-doubt transactions (`GetDecisions`: linearizable, batched, any
//!   node, through a `dtx_client::Client` and its retry policy) on start
//!   and periodically (once per incarnation), and applies the known ones;
//!   undecided ones, and those the cluster says another incarnation handed
//!   out, keep their locks (a participant never decides on its own).
//! - **Log garbage collection** ([`server::collect_decided`], run by the
//!   recovery loop past [`server::RecoveryOptions::log_retention`]) removes
//!   a decided record or a READ_ONLY vote only once the cluster will send
//!   nothing more for it: decided with this participant's ack recorded
//!   (the cluster answers `awaiting_ack` for
//!   [`server::RecoveryOptions::participant_id`]), or forgotten. Until then
//!   a redelivered decision must find the record, or a Commit would be
//!   refused as a commit without prepare, forever.
//!
//! The resource's data lives in the participant's own store. A service
//! whose data is in PostgreSQL uses `postgres::PgParticipant` instead
//! (cargo feature `postgres`; docs/adr/0015-postgresql-participant.md):
//! its handler runs the transaction's SQL, `PREPARE TRANSACTION` makes the
//! YES vote durable, and recovery reconciles `pg_prepared_xacts` with the
//! cluster's decisions. The server and recovery drive either through the
//! [`participant::Participant`] trait.
//!
//! A service whose work cannot prepare takes part in sagas instead
//! ([`saga`]): it runs the steps' forward actions and compensations once
//! per operation id for the cluster's orchestrator
//! (`dtx.v1.SagaStepService`), with an inbox and an outbox in its store
//! (a sled tree, or with the `postgres` feature the service's own
//! PostgreSQL database: `saga_pg`, when built with it).
//!
//! # Example
//!
//! A key-value register: the payload `key=value` sets `key` when the
//! transaction commits. A key is locked from a YES vote to the decision; a
//! Prepare that finds it locked votes NO, so conflicting transactions abort
//! instead of waiting.
//!
//! ```
//! use std::future::Future;
//! use std::path::Path;
//!
//! use dtx_proto::v1::participant_service_server::ParticipantServiceServer;
//! use participant_sdk::log::Vote;
//! use participant_sdk::GlobalTxid;
//! use participant_sdk::server::{spawn_recovery_with, ParticipantServer, RecoveryOptions};
//! use participant_sdk::store::{ParticipantStore, Resource, Staged, View};
//!
//! struct Register;
//!
//! fn lock_key(key: &str) -> Vec<u8> {
//!     format!("lock/{key}").into_bytes()
//! }
//!
//! fn pending_key(txid: GlobalTxid) -> Vec<u8> {
//!     format!("pending/{txid}").into_bytes()
//! }
//!
//! fn parse(payload: &[u8]) -> Option<(String, String)> {
//!     let (k, v) = std::str::from_utf8(payload).ok()?.split_once('=')?;
//!     Some((k.to_string(), v.to_string()))
//! }
//!
//! /// The work `txid` prepared here, if any.
//! fn pending(view: &View<'_>, txid: GlobalTxid) -> Option<(String, String)> {
//!     parse(&view.get(&pending_key(txid)).ok()??)
//! }
//!
//! impl Resource for Register {
//!     fn prepare(&self, view: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote {
//!         let Some((key, _)) = parse(payload) else {
//!             return Vote::No;
//!         };
//!         if !matches!(view.get(&lock_key(&key)), Ok(None)) {
//!             return Vote::No; // locked by another prepared transaction
//!         }
//!         // Durable with the YES vote, in the same write.
//!         staged.put(&lock_key(&key), &txid.key_bytes());
//!         staged.put(&pending_key(txid), payload);
//!         Vote::Yes
//!     }
//!
//!     fn commit(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
//!         if let Some((key, value)) = pending(view, txid) {
//!             staged.put(format!("value/{key}").as_bytes(), value.as_bytes());
//!             staged.delete(&lock_key(&key));
//!         }
//!         staged.delete(&pending_key(txid));
//!     }
//!
//!     fn abort(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
//!         if let Some((key, _)) = pending(view, txid) {
//!             staged.delete(&lock_key(&key));
//!         }
//!         staged.delete(&pending_key(txid));
//!     }
//! }
//!
//! /// Serves participant `id` on `listen` until `shutdown`, or until its
//! /// store stops (an error: exit and let the supervisor restart it).
//! async fn serve(
//!     id: &str,
//!     listen: &str,
//!     data_dir: &Path,
//!     cluster: Vec<String>,
//!     shutdown: impl Future<Output = ()>,
//! ) -> Result<(), Box<dyn std::error::Error>> {
//!     let store = ParticipantStore::open(data_dir, Register)?;
//!     let opts = RecoveryOptions {
//!         participant_id: id.to_string(), // as enlisted: for log garbage collection
//!         ..RecoveryOptions::default()
//!     };
//!     let recovery = spawn_recovery_with(store.clone(), cluster, opts);
//!     let listener = tokio::net::TcpListener::bind(listen).await?;
//!     let stop = {
//!         let store = store.clone();
//!         async move {
//!             tokio::select! {
//!                 _ = shutdown => {}
//!                 f = store.stopped() => eprintln!("{id} stopping: {f}"),
//!             }
//!         }
//!     };
//!     tonic::transport::Server::builder()
//!         .add_service(ParticipantServiceServer::new(ParticipantServer::new(store.clone(), id)))
//!         .serve_with_incoming_shutdown(dtx_transport::incoming(listener), stop)
//!         .await?;
//!     recovery.abort();
//!     match store.failure() {
//!         Some(f) => Err(f.to_string().into()),
//!         None => Ok(()),
//!     }
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let cluster = vec!["127.0.0.1:7201".to_string(), "127.0.0.1:7202".to_string()];
//! #   let dir = tempfile::tempdir()?;
//! #   let data_dir = dir.path();
//! #   let ctrl_c = async {}; // here: stop at once
//! #   /*
//!     let data_dir = Path::new("/var/lib/register-1");
//!     let ctrl_c = async { tokio::signal::ctrl_c().await.unwrap() };
//! #   */
//!     serve("register-1", "127.0.0.1:0", data_dir, cluster, ctrl_c).await
//! }
//! ```

/// Branches that prepare where they run (docs/protocol.md, "Branches").
pub mod branch;
mod kv;
pub mod log;
pub use log::GlobalTxid;
pub mod metrics;
/// An outbox and an inbox for any service (docs/outbox.md).
pub mod outbox;
pub mod participant;
// The PostgreSQL participant's and step store's pools, sessions and TLS
// (ADR 0035).
#[cfg(feature = "postgres")]
mod pg_pool;
#[cfg(feature = "postgres")]
mod pg_tls;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod saga;
#[cfg(feature = "postgres")]
pub mod saga_pg;
pub mod server;
pub mod store;
