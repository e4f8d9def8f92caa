//! A NO vote carries its reason to the coordinator: the reason a resource
//! gives with `Staged::refuse` reaches the PrepareResponse, each PrepareMany
//! item and the one-phase answer, and a repeated Prepare of a transaction
//! refused before says why it is NO. Also pins that a refusal discards what
//! the resource had staged.

use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_server::ParticipantService;
use participant_sdk::log::Vote;
use participant_sdk::participant::Participant;
use participant_sdk::server::ParticipantServer;
use participant_sdk::store::ParticipantStore;
use participant_sdk::store::Resource;
use participant_sdk::store::Staged;
use participant_sdk::store::View;
use participant_sdk::GlobalTxid;

/// Payload "ok" votes YES (and writes `done/<txid>` at commit); "plain-no"
/// votes NO without a reason; anything else is refused with a reason that
/// names the payload, after staging a write that must not survive.
struct Picky;

impl Resource for Picky {
    fn prepare(&self, _view: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote {
        match payload {
            b"ok" => Vote::Yes,
            b"plain-no" => Vote::No,
            other => {
                staged.put(format!("leak/{txid}").as_bytes(), b"x");
                staged.refuse(format!("cannot do {:?}", String::from_utf8_lossy(other)))
            }
        }
    }

    fn commit(&self, _view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        staged.put(format!("done/{txid}").as_bytes(), b"1");
    }

    fn abort(&self, _view: &View<'_>, _txid: GlobalTxid, _staged: &mut Staged) {}
}

fn prepare_req(txid: u64, payload: &[u8]) -> pb::PrepareRequest {
    pb::PrepareRequest {
        txid,
        term: 1,
        participant_id: "p".into(),
        payload: payload.to_vec(),
        incarnation: 0,
    }
}

#[tokio::test]
async fn a_no_vote_carries_the_resources_reason_on_every_path() {
    let dir = tempfile::tempdir().unwrap();
    let store = ParticipantStore::open(dir.path(), Picky).unwrap();
    let server = ParticipantServer::new(store.clone(), "p");

    // Prepare.
    let r = server
        .prepare(tonic::Request::new(prepare_req(1, b"fly")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.vote, pb::Vote::No as i32);
    assert_eq!(r.reason, "cannot do \"fly\"");
    assert_eq!(
        store.view().get(b"leak/1").unwrap(),
        None,
        "a refusal keeps nothing it staged"
    );

    // The repeat answers from the log, and says so.
    let again = server
        .prepare(tonic::Request::new(prepare_req(1, b"fly")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.vote, pb::Vote::No as i32);
    assert!(again.reason.contains("aborted here before"), "{}", again.reason);

    // A NO without a reason gets the default one, never an empty text.
    let plain = server
        .prepare(tonic::Request::new(prepare_req(2, b"plain-no")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(plain.reason, "the resource refused");

    // A YES has no reason.
    let yes = server
        .prepare(tonic::Request::new(prepare_req(3, b"ok")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((yes.vote, yes.reason.as_str()), (pb::Vote::Yes as i32, ""));

    // PrepareMany: each item with its own reason.
    let many = server
        .prepare_many(tonic::Request::new(pb::PrepareManyRequest {
            items: vec![prepare_req(4, b"swim"), prepare_req(5, b"ok"), prepare_req(6, b"run")],
            decisions: vec![],
        }))
        .await
        .unwrap()
        .into_inner();
    let got: Vec<(i32, &str)> = many.results.iter().map(|r| (r.vote, r.reason.as_str())).collect();
    assert_eq!(
        got,
        vec![
            (pb::Vote::No as i32, "cannot do \"swim\""),
            (pb::Vote::Yes as i32, ""),
            (pb::Vote::No as i32, "cannot do \"run\""),
        ]
    );

    // One phase: not committed, with the reason.
    let one = server
        .commit_one_phase(tonic::Request::new(prepare_req(7, b"dance")))
        .await
        .unwrap()
        .into_inner();
    assert!(!one.committed);
    assert_eq!(one.reason, "cannot do \"dance\"");
    assert_eq!(store.view().get(b"leak/7").unwrap(), None);

    // The same through the Participant trait the server drives.
    let answer = Participant::handle(
        &store,
        8.into(),
        participant_sdk::log::Message::Prepare { term: 1 },
        b"sing",
    )
    .await
    .unwrap();
    assert_eq!(answer.reason, "cannot do \"sing\"");
}
