//! A participant's own view (`ParticipantService.Inspect`). An operator
//! explaining a stuck transaction sees what the participant's durable log
//! holds: every state with the term it saw (invariant 9) and when, the
//! transactions held in doubt (a YES vote without a known decision: locks
//! held, invariant 5) flagged and counted, and the most recent records.
//! Inspect is read-only: the store is the same before and after, and a txid
//! never seen is answered "no record" without getting a tombstone
//! (invariant 8: only an Abort leaves one). Its lists are bounded by
//! `limits::INSPECT_RECORDS_MAX`, and with TLS only nodes and operators may
//! call it.

use std::sync::Arc;
use std::time::Duration;

use dtx_proto::limits::INSPECT_RECORDS_MAX;
use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_client::ParticipantServiceClient;
use dtx_proto::v1::participant_service_server::ParticipantService;
use dtx_tls::dev::DevCa;
use dtx_tls::dev::Host;
use dtx_tls::dev::DEV_LIFETIME;
use dtx_tls::Role;
use participant_sdk::log::Message;
use participant_sdk::log::Vote;
use participant_sdk::server::Guard;
use participant_sdk::server::ParticipantServer;
use participant_sdk::server::RecoveryOptions;
use participant_sdk::store::ParticipantStore;
use participant_sdk::store::Resource;
use participant_sdk::store::Staged;
use participant_sdk::store::View;
use participant_sdk::GlobalTxid;

/// Payload "no" votes NO, "ro" READ_ONLY, anything else YES (staging it).
struct Stage;

impl Resource for Stage {
    fn prepare(&self, _v: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote {
        match payload {
            b"no" => staged.refuse("asked to"),
            b"ro" => Vote::ReadOnly,
            _ => {
                staged.put(format!("staged/{txid}").as_bytes(), payload);
                Vote::Yes
            }
        }
    }
    fn commit(&self, _v: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        staged.delete(format!("staged/{txid}").as_bytes());
        staged.put(format!("applied/{txid}").as_bytes(), b"1");
    }
    fn abort(&self, _v: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        staged.delete(format!("staged/{txid}").as_bytes());
    }
}

type Store = Arc<ParticipantStore<Stage>>;

async fn prepare(s: &Store, txid: u64, term: u64, payload: &[u8]) {
    s.handle(txid, Message::Prepare { term }, payload).await.unwrap();
}

async fn inspect(
    server: &ParticipantServer<ParticipantStore<Stage>>,
    txids: &[u64],
    in_doubt: bool,
    recent: u32,
) -> pb::InspectParticipantResponse {
    server
        .inspect(tonic::Request::new(pb::InspectParticipantRequest {
            txids: txids.to_vec(),
            in_doubt,
            recent,
            incarnation: 0,
        }))
        .await
        .unwrap()
        .into_inner()
}

/// Every key and value the store holds.
fn dump(s: &Store) -> Vec<(Vec<u8>, Vec<u8>)> {
    s.raw().dump()
}

fn record(r: &pb::ParticipantRecord) -> pb::LocalRecord {
    pb::LocalRecord::try_from(r.record).unwrap()
}

fn vote(r: &pb::ParticipantRecord) -> pb::Vote {
    pb::Vote::try_from(r.vote).unwrap()
}

#[tokio::test]
async fn inv9_every_state_shows_with_its_term_and_the_in_doubt_ones_are_flagged() {
    let dir = tempfile::tempdir().unwrap();
    let s = ParticipantStore::open(dir.path(), Stage).unwrap();
    let server = ParticipantServer::new(s.clone(), "p");
    let before_ms = participant_sdk::store::unix_ms();
    // In term order: a Prepare of a txid without a record from below the
    // highest term recorded is refused (the term floor, invariant 9).
    prepare(&s, 2, 1, b"x").await;
    prepare(&s, 3, 1, b"no").await; // voted NO: aborted
    prepare(&s, 6, 1, b"x").await;
    s.handle(6, Message::Abort { term: 1 }, b"").await.unwrap(); // YES, then ABORT
    s.handle(2, Message::Commit { term: 2 }, b"").await.unwrap(); // committed, term 2
    prepare(&s, 1, 3, b"x").await; // in doubt, term 3
    prepare(&s, 5, 4, b"ro").await; // read-only
    s.handle(4, Message::Abort { term: 5 }, b"").await.unwrap(); // tombstone, term 5
    let after_ms = participant_sdk::store::unix_ms();

    let r = inspect(&server, &[1, 2, 3, 4, 5, 6, 99, 2], true, 0).await;
    assert_eq!(r.participant_id, "p");
    let expect = [
        (1, pb::LocalRecord::PreparedYes, pb::Vote::Yes, 3, true),
        (2, pb::LocalRecord::Committed, pb::Vote::Yes, 2, false),
        (3, pb::LocalRecord::Aborted, pb::Vote::Unspecified, 1, false),
        (4, pb::LocalRecord::Tombstone, pb::Vote::Unspecified, 5, false),
        (5, pb::LocalRecord::PreparedReadOnly, pb::Vote::ReadOnly, 4, false),
        (6, pb::LocalRecord::Aborted, pb::Vote::Unspecified, 1, false),
        (99, pb::LocalRecord::None, pb::Vote::Unspecified, 0, false),
        (2, pb::LocalRecord::Committed, pb::Vote::Yes, 2, false),
    ];
    assert_eq!(r.records.len(), expect.len(), "one per asked txid, in order: {r:?}");
    for (got, (txid, rec, v, term, doubt)) in r.records.iter().zip(expect) {
        assert_eq!(got.txid, txid);
        assert_eq!(record(got), rec, "{got:?}");
        assert_eq!(vote(got), v, "{got:?}");
        assert_eq!(got.term, term, "{got:?}");
        assert_eq!(got.in_doubt, doubt, "{got:?}");
        if txid == 99 {
            assert_eq!(got.recorded_unix_ms, 0, "no record, no time");
        } else {
            // Every one was recorded by this process: its time is kept.
            assert!(
                (before_ms..=after_ms).contains(&got.recorded_unix_ms),
                "{got:?} not recorded between {before_ms} and {after_ms}"
            );
        }
    }
    // The in-doubt list and the counts.
    assert_eq!(r.in_doubt.iter().map(|x| x.txid).collect::<Vec<_>>(), vec![1]);
    assert!(r.in_doubt[0].in_doubt && r.in_doubt[0].term == 3);
    assert_eq!(r.in_doubt_count, 1);
    assert_eq!(r.records_total, 6, "six records; 99 has none");
    assert!(r.oldest_in_doubt_age_ms < 60_000, "{r:?}");
    assert!(r.now_unix_ms >= after_ms);
    assert!(r.recent.is_empty(), "not asked");

    // The most recent records: newest first, at most as many as asked.
    let all = inspect(&server, &[], false, 100).await;
    assert!(all.records.is_empty() && all.in_doubt.is_empty(), "not asked");
    assert_eq!(all.in_doubt_count, 1, "counted even when not listed");
    let mut txids: Vec<u64> = all.recent.iter().map(|x| x.txid).collect();
    let times: Vec<u64> = all.recent.iter().map(|x| x.recorded_unix_ms).collect();
    assert!(times.windows(2).all(|w| w[0] >= w[1]), "newest first: {all:?}");
    txids.sort();
    assert_eq!(txids, vec![1, 2, 3, 4, 5, 6]);
    let two = inspect(&server, &[], false, 2).await;
    assert_eq!(two.recent.len(), 2);
    assert_eq!(two.recent[..], all.recent[..2]);

    // Decided: no longer in doubt.
    s.handle(1, Message::Commit { term: 3 }, b"").await.unwrap();
    let r = inspect(&server, &[1], true, 0).await;
    assert_eq!(record(&r.records[0]), pb::LocalRecord::Committed);
    assert!(!r.records[0].in_doubt);
    assert!(r.in_doubt.is_empty());
    assert_eq!((r.in_doubt_count, r.oldest_in_doubt_age_ms), (0, 0));
}

#[tokio::test]
async fn inv8_inspect_changes_nothing_and_an_unknown_txid_gets_no_tombstone() {
    let dir = tempfile::tempdir().unwrap();
    let s = ParticipantStore::open(dir.path(), Stage).unwrap();
    let server = ParticipantServer::new(s.clone(), "p");
    prepare(&s, 1, 2, b"x").await;
    prepare(&s, 2, 2, b"x").await;
    s.handle(2, Message::Commit { term: 2 }, b"").await.unwrap();
    s.handle(3, Message::Abort { term: 2 }, b"").await.unwrap();

    let before = dump(&s);
    for _ in 0..3 {
        let r = inspect(&server, &[77, 1, 2, 3, 77], true, INSPECT_RECORDS_MAX as u32).await;
        assert_eq!(record(&r.records[0]), pb::LocalRecord::None, "never seen here");
        assert_eq!(r.records[0].term, 0);
        assert_eq!(record(&r.records[4]), pb::LocalRecord::None);
    }
    assert_eq!(dump(&s), before, "Inspect wrote to the store");
    assert_eq!(s.entry(77).unwrap(), None, "no tombstone, no record");
    // A late Prepare of the txid asked about votes as if nobody had asked
    // (a tombstone would make it NO).
    assert_eq!(
        s.handle(77, Message::Prepare { term: 2 }, b"x").await.unwrap(),
        participant_sdk::store::Reply::Vote(Vote::Yes)
    );
}

#[tokio::test]
async fn votes_from_before_a_restart_are_in_doubt_oldest_first_without_a_time() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = ParticipantStore::open(dir.path(), Stage).unwrap();
        prepare(&s, 10, 1, b"x").await;
    }
    let s = ParticipantStore::open(dir.path(), Stage).unwrap();
    let server = ParticipantServer::new(s.clone(), "p");
    tokio::time::sleep(Duration::from_millis(20)).await;
    prepare(&s, 11, 1, b"x").await;
    let r = inspect(&server, &[10, 11], true, 10).await;
    let doubt: Vec<(u64, bool)> = r.in_doubt.iter().map(|x| (x.txid, x.recorded_unix_ms > 0)).collect();
    assert_eq!(
        doubt,
        vec![(10, false), (11, true)],
        "the vote from before the restart (time not kept) is the oldest: {r:?}"
    );
    assert!(r.in_doubt.iter().all(|x| x.in_doubt && x.term == 1));
    assert_eq!(r.in_doubt_count, 2);
    assert!(
        r.oldest_in_doubt_age_ms >= 20,
        "counted from the store's opening at least: {r:?}"
    );
    let recent: Vec<u64> = r.recent.iter().map(|x| x.txid).collect();
    assert_eq!(recent, vec![11, 10], "no time kept: last");
}

#[tokio::test]
async fn limits_are_refused_with_invalid_argument_naming_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let s = ParticipantStore::open(dir.path(), Stage).unwrap();
    let server = ParticipantServer::new(s.clone(), "p");
    let ask = |txids: Vec<u64>, recent: u32| {
        server.inspect(tonic::Request::new(pb::InspectParticipantRequest {
            txids,
            in_doubt: true,
            recent,
            incarnation: 0,
        }))
    };
    let too_many: Vec<u64> = (1..=INSPECT_RECORDS_MAX as u64 + 1).collect();
    for st in [
        ask(too_many.clone(), 0).await.unwrap_err(),
        ask(Vec::new(), INSPECT_RECORDS_MAX as u32 + 1).await.unwrap_err(),
        ask(Vec::new(), u32::MAX).await.unwrap_err(),
    ] {
        assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
        assert!(st.message().contains("INSPECT_RECORDS_MAX"), "{st:?}");
    }
    // At the limit: answered.
    let r = ask(too_many[..INSPECT_RECORDS_MAX].to_vec(), INSPECT_RECORDS_MAX as u32)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.records.len(), INSPECT_RECORDS_MAX);
    assert!(r.records.iter().all(|x| record(x) == pb::LocalRecord::None));
    assert_eq!(s.entries().unwrap(), vec![], "still nothing recorded");
}

/// A participant served with TLS: who may call Inspect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv12_with_tls_nodes_and_operators_may_inspect_and_nobody_else() {
    let dir = tempfile::tempdir().unwrap();
    let ca = DevCa::new("t43").unwrap();
    let ca_path = ca.write_ca(dir.path()).unwrap();
    let hosts = [Host::parse("127.0.0.1")];
    let issue = |role: Role, name: &str| {
        ca.issue_to(dir.path(), &format!("{role}-{name}"), role, name, &hosts, DEV_LIFETIME)
            .unwrap()
    };
    let server_tls = dtx_tls::ServerTls::load(dtx_tls::server::ServerTlsFiles {
        own: issue(Role::Participant, "p"),
        ca: ca_path.clone(),
        client_auth: dtx_tls::ClientAuth::Required,
    })
    .unwrap();
    let store = ParticipantStore::open(&dir.path().join("store"), Stage).unwrap();
    prepare(&store, 1, 1, b"x").await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(participant_sdk::server::serve_guarded(
        store.clone(),
        "p",
        listener,
        vec!["127.0.0.1:1".into()],
        RecoveryOptions {
            log_retention: None,
            ..RecoveryOptions::default()
        },
        Guard {
            tls: Some(server_tls),
            node_tokens: Default::default(),
        },
        async {
            let _ = stopped.await;
        },
    ));
    let client = |role: Role, name: &str| {
        let tls = dtx_tls::ClientTls::load(dtx_tls::client::ClientTlsFiles {
            ca: ca_path.clone(),
            own: Some(issue(role, name)),
            server_name: None,
        })
        .unwrap();
        let ch = dtx_transport::channel::channel_with(&addr, None, Duration::from_secs(2), Some(&tls)).unwrap();
        ParticipantServiceClient::new(ch)
    };
    let req = || pb::InspectParticipantRequest {
        txids: vec![1],
        in_doubt: true,
        recent: 0,
        incarnation: 0,
    };
    for (role, name) in [(Role::Node, "1"), (Role::Operator, "alice")] {
        let r = client(role, name).inspect(req()).await.unwrap().into_inner();
        assert_eq!(r.in_doubt_count, 1, "{role}");
        assert_eq!(record(&r.records[0]), pb::LocalRecord::PreparedYes, "{role}");
    }
    // An operator may look, not decide.
    let st = client(Role::Operator, "alice")
        .commit(pb::ParticipantDecisionRequest {
            txid: 1,
            term: 1,
            participant_id: "p".into(),
            incarnation: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::PermissionDenied, "{st:?}");
    for (role, name) in [(Role::Application, "shop"), (Role::Participant, "other")] {
        let st = client(role, name).inspect(req()).await.unwrap_err();
        assert_eq!(st.code(), tonic::Code::PermissionDenied, "{role}: {st:?}");
    }
    assert_eq!(
        store.entry(1).unwrap().map(|e| e.state),
        Some(participant_sdk::log::LocalState::Prepared { vote: Vote::Yes }),
        "still in doubt: nobody decided"
    );
    let _ = stop.send(());
    served.await.unwrap().unwrap();
}

/// Without TLS and without node tokens the port is open, Inspect too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_plain_text_without_tokens_inspect_is_open_like_the_rest_of_the_port() {
    let dir = tempfile::tempdir().unwrap();
    let store = ParticipantStore::open(dir.path(), Stage).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(participant_sdk::server::serve(
        store.clone(),
        "p",
        listener,
        vec!["127.0.0.1:1".into()],
        RecoveryOptions {
            log_retention: None,
            ..RecoveryOptions::default()
        },
        async {
            let _ = stopped.await;
        },
    ));
    let ch = dtx_transport::channel::channel_with(&addr, None, Duration::from_secs(2), None).unwrap();
    let r = ParticipantServiceClient::new(ch)
        .inspect(pb::InspectParticipantRequest {
            txids: vec![5],
            in_doubt: true,
            recent: 5,
            incarnation: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.participant_id, "p");
    assert_eq!(record(&r.records[0]), pb::LocalRecord::None);
    let _ = stop.send(());
    served.await.unwrap().unwrap();
}
