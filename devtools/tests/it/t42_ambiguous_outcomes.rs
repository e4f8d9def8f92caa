//! A call whose effect is not known is UNKNOWN at the client, always. tonic
//! reports an HTTP/2 reset or a broken stream as INTERNAL, and a server that
//! fails after proposing answers INTERNAL too; the client used to report
//! those as definite failures.
//!
//! A stand-in coordinator on a real socket answers the way a failing server
//! does: INTERNAL without the "not applied" marker, a handler that panics
//! (the stream is reset), and INTERNAL with the marker (certainly not
//! applied: a definite failure). Reads have no effect, so an INTERNAL read
//! stays a plain error.

use std::time::Duration;

use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_client::ClientError;
use dtx_client::TxOutcome;
use dtx_proto::metadata::NOT_APPLIED_HEADER;
use dtx_proto::v1 as pb;
use dtx_proto::v1::coordinator_server::Coordinator;
use dtx_proto::v1::coordinator_server::CoordinatorServer;
use tonic::Request;
use tonic::Response;
use tonic::Status;

/// Counts the Begin calls it received.
#[derive(Default)]
struct Failing {
    begins: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

/// The timeout a request carries (its `grpc-timeout` header).
fn request_timeout<T>(r: &Request<T>) -> Option<Duration> {
    let headers = r.metadata().clone().into_headers();
    dtx_transport::unary::grpc_timeout(headers.get("grpc-timeout")?)
}

fn internal_not_applied() -> Status {
    let mut s = Status::internal("refused before anything was proposed");
    s.metadata_mut().insert(NOT_APPLIED_HEADER, "1".parse().unwrap());
    s
}

#[tonic::async_trait]
impl Coordinator for Failing {
    async fn register_branch(
        &self,
        _r: Request<pb::RegisterBranchRequest>,
    ) -> Result<Response<pb::RegisterBranchResponse>, Status> {
        Err(Status::unimplemented("not in this stand-in"))
    }
    async fn get_branch_decision(
        &self,
        _r: Request<pb::GetBranchDecisionRequest>,
    ) -> Result<Response<pb::GetBranchDecisionResponse>, Status> {
        Err(Status::unimplemented("not in this stand-in"))
    }
    async fn begin(&self, _r: Request<pb::BeginRequest>) -> Result<Response<pb::BeginResponse>, Status> {
        self.begins.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Err(internal_not_applied())
    }
    async fn enlist(&self, r: Request<pb::EnlistRequest>) -> Result<Response<pb::EnlistResponse>, Status> {
        // An attempt the call's deadline cut short (under 300 ms left): the
        // answer comes too late, as on a busy machine, and the request's
        // own timeout fires first. The client must still report the
        // failure before it, not the timeout.
        if request_timeout(&r).is_some_and(|t| t < Duration::from_millis(300)) {
            tokio::time::sleep(Duration::from_secs(10)).await;
        }
        // A server that failed after it proposed: may be applied.
        Err(Status::internal("the driver stopped"))
    }
    async fn begin_and_commit(
        &self,
        _r: Request<pb::BeginAndCommitRequest>,
    ) -> Result<Response<pb::BeginAndCommitResponse>, Status> {
        Err(Status::internal("h2 protocol error: stream reset"))
    }
    async fn commit(&self, _r: Request<pb::CommitRequest>) -> Result<Response<pb::CommitResponse>, Status> {
        Err(Status::internal("h2 protocol error: stream reset"))
    }
    async fn abort(&self, _r: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        // The handler dies mid-call: the client's stream is reset.
        panic!("handler died mid-call (this panic is part of the test)");
    }
    async fn status(&self, _r: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        Err(Status::internal("read failed"))
    }
    async fn get_decision(
        &self,
        _r: Request<pb::GetDecisionRequest>,
    ) -> Result<Response<pb::GetDecisionResponse>, Status> {
        Err(Status::internal("read failed"))
    }
    async fn get_decisions(
        &self,
        _r: Request<pb::GetDecisionsRequest>,
    ) -> Result<Response<pb::GetDecisionsResponse>, Status> {
        Err(Status::internal("read failed"))
    }
}

/// The stand-in's address and its Begin counter.
async fn serve_failing() -> (String, std::sync::Arc<std::sync::atomic::AtomicU32>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let failing = Failing::default();
    let begins = failing.begins.clone();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(CoordinatorServer::new(failing))
            .serve_with_incoming(dtx_transport::incoming(listener)),
    );
    (addr, begins)
}

fn client(addr: &str) -> Client {
    let mut cfg = ClientConfig::new(vec![addr.to_string()]);
    cfg.call_deadline = Duration::from_millis(800);
    cfg.attempt_timeout = Duration::from_millis(400);
    cfg.backoff_max = Duration::from_millis(50);
    Client::new(cfg).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t42_internal_or_reset_on_a_write_is_unknown_never_a_failure() {
    let (addr, _) = serve_failing().await;
    let cl = client(&addr);

    // INTERNAL without "not applied" on Commit: UNKNOWN.
    assert_eq!(cl.commit(7).await.unwrap(), TxOutcome::Unknown);
    // The handler panics (stream reset) on Abort: UNKNOWN.
    assert_eq!(cl.abort(7, "why").await.unwrap(), TxOutcome::Unknown);
    // BeginAndCommit: UNKNOWN without a txid (ask again with the same key).
    let r = cl.begin_and_commit("k", 1_000, b"", &[]).await.unwrap();
    assert_eq!((r.txid, r.outcome), (None, TxOutcome::Unknown));
    // Enlist has no UNKNOWN outcome value: the error is Unknown, not Internal.
    match cl.enlist(7, "p", "127.0.0.1:1", b"").await {
        Err(ClientError::Unknown(m)) => assert!(m.contains("driver stopped"), "{m}"),
        other => panic!("enlist after an INTERNAL must be Unknown: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t42_internal_marked_not_applied_and_failed_reads_stay_definite() {
    let (addr, begins) = serve_failing().await;
    let cl = client(&addr);
    // The server says it certainly did nothing: a plain failure, at once.
    match cl.begin("k", 1_000, b"").await {
        Err(ClientError::Internal(m)) => assert!(m.contains("refused before"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        begins.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "asked once, not retried"
    );
    // A read has no effect: INTERNAL is a plain error.
    assert!(matches!(cl.decision(7).await, Err(ClientError::Internal(_))));
}
