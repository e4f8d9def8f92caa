//! A participant address the coordinator could not connect to is refused
//! when it is given (Enlist, BeginAndCommit) with INVALID_ARGUMENT naming the
//! participant, the field and what is wrong, instead of showing up later as
//! an ABORT at commit time. `https://` is refused too: there is no TLS yet,
//! and using it as plain text would be a silent downgrade. Nothing is
//! recorded for a refused call.

use crate::common;

use std::time::Duration;

use common::TestCluster;
use dtx_proto::v1 as pb;
use dtx_proto::v1::coordinator_client::CoordinatorClient;
use dtx_transport::channel::Channel;

fn assert_refused(r: Result<impl std::fmt::Debug, tonic::Status>, addr: &str, why: &str) {
    match r {
        Err(s) => {
            assert_eq!(s.code(), tonic::Code::InvalidArgument, "{addr}: {s:?}");
            let m = s.message();
            assert!(
                m.contains("\"bank-a\"") && m.contains("address") && m.contains(why),
                "{addr}: the refusal should name the participant, the field and {why:?}: {m}"
            );
            assert!(
                m.contains("host:port"),
                "{addr}: the refusal should say what is accepted: {m}"
            );
        }
        Ok(v) => panic!("{addr} was accepted: {v:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t41_enlist_and_begin_and_commit_refuse_unusable_addresses() {
    let mut c = TestCluster::start_with("t41", 1, |_| {});
    let leader = c.leader().await;
    let ch: Channel = coordinator::raft::network::channel(&c.api(leader), None, Duration::from_secs(2)).unwrap();
    let mut api = CoordinatorClient::new(ch);
    let txid = c.client().begin("t41-a", 60_000, b"").await.unwrap().txid;

    let bad = [
        ("https://127.0.0.1:7000", "TLS"),
        ("127.0.0.1", "no port"),
        ("127.0.0.1:http", "not a number"),
        ("grpc://127.0.0.1:7000", "unsupported scheme"),
        ("bank a:7000", "whitespace"),
    ];
    for (addr, why) in bad {
        let r = api
            .enlist(pb::EnlistRequest {
                txid,
                participant_id: "bank-a".into(),
                address: addr.into(),
                payload: Vec::new(),
            })
            .await;
        assert_refused(r, addr, why);
    }
    let st = api.status(pb::StatusRequest { txid }).await.unwrap().into_inner();
    assert!(
        st.participants.is_empty(),
        "a refused Enlist left a participant: {st:?}"
    );
    // What is accepted is still accepted.
    for (i, addr) in ["127.0.0.1:7000", "http://127.0.0.1:7001"].into_iter().enumerate() {
        api.enlist(pb::EnlistRequest {
            txid,
            participant_id: format!("ok-{i}"),
            address: addr.into(),
            payload: Vec::new(),
        })
        .await
        .unwrap_or_else(|s| panic!("{addr}: {s:?}"));
    }

    // BeginAndCommit: the same check, before anything is proposed, so the
    // key stays unused (a Begin with it afterwards starts a new transaction).
    for (addr, why) in bad {
        let r = api
            .begin_and_commit(pb::BeginAndCommitRequest {
                idempotency_key: "t41-b".into(),
                timeout_ms: 60_000,
                description: Vec::new(),
                participants: vec![
                    pb::ParticipantSpec {
                        participant_id: "ok".into(),
                        address: "127.0.0.1:7000".into(),
                        payload: Vec::new(),
                    },
                    pb::ParticipantSpec {
                        participant_id: "bank-a".into(),
                        address: addr.into(),
                        payload: Vec::new(),
                    },
                ],
            })
            .await;
        assert_refused(r, addr, why);
    }
    let b = c.client().begin("t41-b", 60_000, b"").await.unwrap();
    assert!(!b.existing, "a refused BeginAndCommit used its key");
    assert_eq!(b.txid, txid + 1, "a refused BeginAndCommit used a txid");
}
