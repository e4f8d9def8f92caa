//! Our unary transport (`dtx_transport::unary`, ADR 0026) against the faults a
//! caller meets: a server that stops answering (what a SIGSTOPped node
//! looks like: the kernel still accepts and ACKs, nothing answers), a
//! server whose connections are cut (a killed node), and an address where
//! nothing listens (a node that is down). Each test runs a real tonic
//! server on a loopback socket; between it and the channel runs a TCP
//! relay that can hold every byte in both directions (`freeze`) or close
//! every connection it carries (`cut`).
//!
//! What a node, the client library and the SDK rely on, each checked here:
//! a call's own deadline ends it even when the server is silent; an
//! unanswered keep-alive ping ends calls that have no deadline; a call in
//! flight on a cut connection fails at once and is not reported as "never
//! sent"; the next call after a failed connection connects again; a
//! failed connect is UNAVAILABLE with tonic's `ConnectError` in its source
//! chain; messages larger than HTTP/2's flow-control windows arrive whole.

use std::net::SocketAddr;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use dtx_proto::v1::raft_transport_client::RaftTransportClient;
use dtx_proto::v1::raft_transport_server::RaftTransport;
use dtx_proto::v1::raft_transport_server::RaftTransportServer;
use dtx_proto::v1::ProbeRequest;
use dtx_proto::v1::ProbeResponse;
use dtx_proto::v1::RaftMessage;
use dtx_transport::channel::Channel;
use dtx_transport::unary::nothing_sent;
use dtx_transport::unary::KEEP_ALIVE_INTERVAL;
use dtx_transport::unary::KEEP_ALIVE_TIMEOUT;
use tokio::io::AsyncReadExt;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpListener;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tonic::Code;
use tonic::Request;
use tonic::Response;
use tonic::Status;

/// Echoes AppendEntries; answers Probe with a fixed node id.
struct Echo;

const NODE_ID: u64 = 7;

#[tonic::async_trait]
impl RaftTransport for Echo {
    async fn append_entries(&self, r: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        Ok(Response::new(r.into_inner()))
    }

    async fn vote(&self, _: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        Err(Status::unimplemented("this test server only echoes AppendEntries"))
    }

    async fn install_snapshot(&self, _: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        Err(Status::unimplemented("this test server only echoes AppendEntries"))
    }

    async fn probe(&self, _: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        Ok(Response::new(ProbeResponse { node_id: NODE_ID }))
    }
}

/// A tonic server on a fresh loopback port.
async fn server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind the server");
    let addr = l.local_addr().expect("server address");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RaftTransportServer::new(Echo))
            .serve_with_incoming(dtx_transport::incoming(l)),
    );
    addr
}

/// A TCP relay to `to` that can hold all bytes or close all connections.
struct Relay {
    addr: SocketAddr,
    frozen: watch::Sender<bool>,
    /// Bumped by `cut`: every connection accepted before it closes.
    generation: watch::Sender<u64>,
    accepted: Arc<AtomicUsize>,
}

impl Relay {
    async fn start(to: SocketAddr) -> Relay {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind the relay");
        let addr = l.local_addr().expect("relay address");
        let (frozen, frozen_rx) = watch::channel(false);
        let (generation, generation_rx) = watch::channel(0u64);
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = l.accept().await else { return };
                count.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = TcpStream::connect(to).await else {
                    return;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (client_r, client_w) = client.into_split();
                let (server_r, server_w) = server.into_split();
                let born = *generation_rx.borrow();
                let mut cut = generation_rx.clone();
                let (f1, f2) = (frozen_rx.clone(), frozen_rx.clone());
                tokio::spawn(async move {
                    // Either direction ending, or a cut, drops all four
                    // halves: both sockets close.
                    tokio::select! {
                        _ = pipe(client_r, server_w, f1) => {}
                        _ = pipe(server_r, client_w, f2) => {}
                        _ = cut.wait_for(|g| *g != born) => {}
                    }
                });
            }
        });
        Relay {
            addr,
            frozen,
            generation,
            accepted,
        }
    }

    fn freeze(&self, on: bool) {
        self.frozen.send_replace(on);
    }

    fn cut(&self) {
        self.generation.send_modify(|g| *g += 1);
    }

    fn connections(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

/// Copies `from` to `to`, holding whatever it has read while frozen.
async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut frozen: watch::Receiver<bool>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if frozen.wait_for(|f| !*f).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.wait_for(|f| !*f).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

fn client(addr: SocketAddr) -> RaftTransportClient<Channel> {
    let ch = dtx_transport::channel::channel(&addr.to_string(), None, Duration::from_millis(500)).expect("channel");
    RaftTransportClient::new(ch)
}

async fn echo(
    c: &mut RaftTransportClient<Channel>,
    payload: Vec<u8>,
    deadline: Option<Duration>,
) -> Result<Vec<u8>, Status> {
    let mut r = Request::new(RaftMessage { payload });
    if let Some(d) = deadline {
        r.set_timeout(d);
    }
    c.append_entries(r).await.map(|r| r.into_inner().payload)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// The limit on how long any one step may take before the test calls the
/// transport hung (far above every deadline used here).
const HUNG_AFTER: Duration = Duration::from_secs(60);

/// A relay to a fresh server, and a client through it that has made one
/// call (so its connection is up).
async fn relay_and_warm_client() -> (Relay, RaftTransportClient<Channel>) {
    let relay = Relay::start(server().await).await;
    let mut c = client(relay.addr);
    assert_eq!(
        echo(&mut c, pattern(64, 1), None).await.expect("warm-up"),
        pattern(64, 1)
    );
    (relay, c)
}

/// A failed call whose request may have reached the server: not OK, and
/// not reported as "never sent" (no `ConnectError`), so a caller treats
/// its outcome as unknown.
fn assert_sent_and_failed(e: &Status) {
    assert_ne!(e.code(), Code::Ok);
    assert!(!nothing_sent(e), "a sent request reported as never sent: {e:?}");
}

/// A call made `when` is answered with its own message.
async fn answered_again(c: &mut RaftTransportClient<Channel>, when: &str) {
    let back = tokio::time::timeout(HUNG_AFTER, echo(c, pattern(64, 3), Some(Duration::from_secs(20))))
        .await
        .unwrap_or_else(|_| panic!("{when} hung"))
        .unwrap_or_else(|e| panic!("{when}: {e:?}"));
    assert_eq!(back, pattern(64, 3), "{when}");
}

#[tokio::test]
async fn small_empty_large_and_concurrent_messages_arrive_whole_on_one_connection() {
    let relay = Relay::start(server().await).await;
    let mut c = client(relay.addr);
    let probe = c.probe(ProbeRequest {}).await.expect("probe").into_inner();
    assert_eq!(probe.node_id, NODE_ID);
    assert_eq!(
        echo(&mut c, Vec::new(), None).await.expect("empty payload"),
        Vec::<u8>::new()
    );
    let small = pattern(64, 1);
    assert_eq!(echo(&mut c, small.clone(), None).await.expect("64 bytes"), small);
    // Larger than the server's 64 KiB initial stream window and than
    // hyper's 2 MiB receive window: h2 must hold the rest of the DATA
    // until the windows open, and the reply must be given back its window.
    for (len, seed) in [(100 * 1024, 2u8), (3 * 1024 * 1024, 3u8)] {
        let big = pattern(len, seed);
        let back = tokio::time::timeout(HUNG_AFTER, echo(&mut c, big.clone(), None))
            .await
            .expect("a large message hung")
            .expect("large message");
        assert!(back == big, "{len} bytes came back different ({} bytes)", back.len());
    }
    // Many calls at once share the one connection, each answered with
    // its own message.
    let calls = (0..64u8).map(|i| {
        let mut c = c.clone();
        tokio::spawn(async move {
            let p = pattern(200 + i as usize * 97, i);
            (p.clone(), echo(&mut c, p, None).await)
        })
    });
    for call in calls {
        let (sent, back) = call.await.expect("call task");
        assert_eq!(back.expect("concurrent call"), sent);
    }
    assert_eq!(relay.connections(), 1, "every call should share one connection");
}

#[tokio::test]
async fn a_silent_server_ends_a_call_at_its_deadline_and_the_connection_serves_again_when_it_resumes() {
    let (relay, mut c) = relay_and_warm_client().await;

    relay.freeze(true);
    let deadline = Duration::from_millis(300);
    let start = Instant::now();
    let e = tokio::time::timeout(HUNG_AFTER, echo(&mut c, pattern(64, 2), Some(deadline)))
        .await
        .expect("a call with a deadline hung on a silent server")
        .expect_err("a silent server answered");
    let took = start.elapsed();
    // CANCELLED, as tonic's own channel reports its deadline: the request
    // may have reached the server (the caller must treat it as unknown).
    assert_eq!(e.code(), Code::Cancelled, "{e:?}");
    assert_sent_and_failed(&e);
    assert!(
        took >= deadline,
        "ended after {took:?}, before its deadline {deadline:?}"
    );
    // Not by the keep-alive, which cannot close the connection sooner than
    // an unanswered ping's timeout after the freeze.
    assert!(
        took < KEEP_ALIVE_TIMEOUT,
        "ended after {took:?}: by the keep-alive, not by the call's deadline"
    );

    relay.freeze(false);
    answered_again(&mut c, "the call after the server resumed").await;
    assert_eq!(relay.connections(), 1, "a short pause should not cost a new connection");
}

#[tokio::test]
async fn a_silent_server_is_dropped_by_the_keep_alive_and_the_next_call_connects_again() {
    let (relay, mut c) = relay_and_warm_client().await;

    relay.freeze(true);
    let start = Instant::now();
    // No deadline of its own: only the keep-alive can end it.
    let e = tokio::time::timeout(HUNG_AFTER, echo(&mut c, pattern(64, 2), None))
        .await
        .expect("a call without a deadline hung on a silent server: the keep-alive did not close the connection")
        .expect_err("a silent server answered");
    let took = start.elapsed();
    assert_sent_and_failed(&e);
    // The first ping after the freeze goes out within one interval, and
    // the connection closes when it has gone unanswered for the timeout.
    assert!(
        took >= KEEP_ALIVE_TIMEOUT,
        "ended after {took:?}, before a ping could time out: {e:?}"
    );
    assert!(
        took <= KEEP_ALIVE_INTERVAL + KEEP_ALIVE_TIMEOUT + Duration::from_secs(15),
        "ended after {took:?}"
    );

    relay.freeze(false);
    answered_again(&mut c, "the call after the keep-alive closed the connection").await;
    assert_eq!(relay.connections(), 2, "the next call should have connected again");
}

#[tokio::test]
async fn a_cut_connection_fails_the_call_in_flight_at_once_and_the_next_call_connects_again() {
    let (relay, mut c) = relay_and_warm_client().await;

    // Held by the relay, so it is in flight when the connection is cut.
    relay.freeze(true);
    let mut in_flight = c.clone();
    let call = tokio::spawn(async move { echo(&mut in_flight, pattern(64, 2), None).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!call.is_finished(), "the held call ended before the cut");
    let start = Instant::now();
    relay.cut();
    relay.freeze(false);
    let e = tokio::time::timeout(HUNG_AFTER, call)
        .await
        .expect("the call on a cut connection hung")
        .expect("call task")
        .expect_err("a call on a cut connection succeeded");
    let took = start.elapsed();
    assert_sent_and_failed(&e);
    // Failed by the connection's end, not by the keep-alive.
    assert!(
        took < KEEP_ALIVE_TIMEOUT,
        "ended {took:?} after the cut: by the keep-alive, not by the cut"
    );

    answered_again(&mut c, "the call after the cut").await;
    assert_eq!(relay.connections(), 2, "the next call should have connected again");
}

#[tokio::test]
async fn nothing_listening_is_unavailable_with_connect_error_and_nothing_sent() {
    // A port bound and never listened on: connecting to it is refused,
    // and no other process can take it while the test holds it.
    let held = tokio::net::TcpSocket::new_v4().expect("socket");
    held.bind(SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind");
    let mut c = client(held.local_addr().expect("address"));
    for attempt in 0..2 {
        let e = tokio::time::timeout(HUNG_AFTER, echo(&mut c, pattern(64, 1), None))
            .await
            .expect("a refused connect hung")
            .expect_err("a call to a closed port succeeded");
        assert_eq!(e.code(), Code::Unavailable, "attempt {attempt}: {e:?}");
        assert!(nothing_sent(&e), "attempt {attempt}: no ConnectError in {e:?}");
    }
}
