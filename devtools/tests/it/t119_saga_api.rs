//! The saga client (`dtx_client::saga`, docs/sagas.md "Saga client")
//! against a real three-node cluster and the order saga's step services as
//! real processes: start by idempotency key, wait, list, follow the leader
//! through a kill; cancel before the pivot (the step in flight asked about
//! and fenced, never taken as failed), refused past it; a saga's deadline.

use crate::common;

use std::time::Duration;

use common::sagas;
use common::sagas::ends;
use common::sagas::wait_for;
use common::sagas::SagaShop;
use common::sagas::ShopFlags;
use common::TestCluster;
use dtx_client::saga::SagaEnd;
use dtx_client::saga::SagaFilter;
use dtx_client::saga::SagaWait;
use dtx_client::saga::StartSaga;
use dtx_client::ClientError;
use dtx_proto::v1 as pb;
use dtx_saga_shop::OrderInput;

const ORDER: &str = dtx_saga_shop::ORDER_SAGA;

fn start_of(definition: &str, o: &OrderInput) -> StartSaga {
    StartSaga::new(definition, 1, &o.order, o.to_json())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t119_the_saga_client_starts_by_key_waits_lists_and_goes_on_through_a_leader_kill() {
    let mut c = TestCluster::start("t119a");
    c.leader().await;
    let mut shop = SagaShop::start(c.dir.path(), ShopFlags::default()).await;
    let client = c.client();
    let d = shop.definition();
    assert!(client.register_saga_definition(&d).await.unwrap(), "registered");
    assert!(
        !client.register_saga_definition(&d).await.unwrap(),
        "the same definition again is a no-op"
    );
    let mut other = d.clone();
    other.steps[0].retry.as_mut().unwrap().max_attempts = 2;
    let e = client.register_saga_definition(&other).await.unwrap_err();
    assert!(matches!(e, ClientError::AlreadyExists(_)), "{e}");
    let defs = client.saga_definitions().await.unwrap();
    assert!(defs.iter().any(|x| x.name == ORDER), "{defs:?}");

    // By key: the same request finds the same saga; another input under
    // the same key is refused, naming the saga.
    let o1 = sagas::order(1, 1, 2, 1, 100);
    let s1 = client.start_saga(&start_of(ORDER, &o1)).await.unwrap();
    assert!(s1.created);
    let again = client.start_saga(&start_of(ORDER, &o1)).await.unwrap();
    assert_eq!((again.saga_id, again.created), (s1.saga_id, false));
    let changed = OrderInput { qty: 3, ..o1.clone() };
    let e = client.start_saga(&start_of(ORDER, &changed)).await.unwrap_err();
    match &e {
        ClientError::AlreadyExists(m) => assert!(
            m.contains(&o1.order) && m.contains(&format!("saga {}", s1.saga_id)) && m.contains("another request"),
            "{m}"
        ),
        other => panic!("another input under the key: {other:?}"),
    }
    // A deadline is part of the request too.
    let e = client
        .start_saga(&start_of(ORDER, &o1).with_deadline(Duration::from_secs(60)))
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::AlreadyExists(_)), "{e}");
    let e = client
        .start_saga(&StartSaga::new("no-such-saga", 1, "k-x", vec![]))
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::NotFound(_)), "{e}");

    let v1 = ends(&client, s1.saga_id, SagaEnd::Completed).await;
    assert!(v1.past_pivot && v1.cancel_reason.is_empty() && v1.deadline_at_ms == 0);

    // The leader is killed while sagas start and run: the client follows
    // the new leader, and the sagas end.
    let mut ids = vec![s1.saga_id];
    for n in 2..=5 {
        if n == 3 {
            let l = c.leader().await;
            c.procs.kill9(l);
            c.procs.start(l).unwrap();
        }
        let o = sagas::order(n, n as u32, 1, n as u32, 50);
        // An UNKNOWN start is settled by starting again with the key.
        let id = loop {
            match client.start_saga(&start_of(ORDER, &o)).await {
                Ok(s) => break s.saga_id,
                Err(ClientError::Unknown(_) | ClientError::NotApplied(_) | ClientError::Unavailable(_)) => continue,
                Err(e) => panic!("start {}: {e}", o.order),
            }
        };
        ids.push(id);
    }
    for id in &ids {
        ends(&client, *id, SagaEnd::Completed).await;
    }

    // Listing by state and definition, paged.
    let all = SagaFilter {
        states: vec![pb::SagaState::Completed],
        definition: ORDER.into(),
        ..SagaFilter::default()
    };
    let page = client.list_sagas(&all).await.unwrap();
    let listed: Vec<u64> = page.sagas.iter().map(|v| v.saga_id).collect();
    assert_eq!(listed, ids, "every saga, in id order");
    assert_eq!(page.next_after_saga_id, None);
    let first = client
        .list_sagas(&SagaFilter {
            limit: 2,
            ..all.clone()
        })
        .await
        .unwrap();
    assert_eq!(first.sagas.len(), 2);
    let rest = client
        .list_sagas(&SagaFilter {
            after_saga_id: first.next_after_saga_id.expect("more to come"),
            ..all.clone()
        })
        .await
        .unwrap();
    assert_eq!(rest.sagas.len(), ids.len() - 2);
    let none = client
        .list_sagas(&SagaFilter {
            states: vec![pb::SagaState::Running, pb::SagaState::Parked],
            ..SagaFilter::default()
        })
        .await
        .unwrap();
    assert!(none.sagas.is_empty(), "{:?}", none.sagas);

    // A saga that does not exist: a definite answer, not a wait.
    let e = client.saga(9_999).await.unwrap_err();
    assert!(matches!(e, ClientError::NotFound(_)), "{e}");
    let e = client.wait_saga(9_999, Duration::from_secs(5)).await.unwrap_err();
    assert!(matches!(e, ClientError::NotFound(_)), "{e}");
    // An ended saga cannot be cancelled.
    let e = client.cancel_saga(s1.saga_id, "too late").await.unwrap_err();
    assert!(matches!(e, ClientError::FailedPrecondition(_)), "{e}");

    let audits = shop.audit_all();
    for n in 1..=5 {
        let order = format!("o-{n}");
        assert_eq!(audits[0].reservations[&order].reserves_applied, 1, "{order}");
        assert_eq!(audits[1].charges[&order].charges_applied, 1, "{order}");
        assert_eq!(audits[2].confirmations[&order].applied, 1, "{order}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t119_cancel_and_deadline_compensate_before_the_pivot_and_are_refused_past_it() {
    // The payment and e-mail services are down at first, so sagas stay
    // RUNNING with a call in flight at them.
    let mut c = TestCluster::start("t119b");
    c.leader().await;
    let mut shop = SagaShop::start(
        c.dir.path(),
        ShopFlags {
            hold_back: vec!["payment", "email"],
            ..ShopFlags::default()
        },
    )
    .await;
    let client = c.client();
    client.register_saga_definition(&shop.definition()).await.unwrap();
    // "hold": reserve stock, then a compensable step at the payment
    // service (down): no pivot is reached while it is down. A long attempt
    // budget, so it does not park while the test acts.
    let mut hold = shop.definition();
    hold.name = "hold".into();
    hold.steps.truncate(2);
    hold.steps[1].kind = pb::StepKind::Compensable as i32;
    hold.steps[1].compensation = "refund".into();
    for s in &mut hold.steps {
        s.retry.as_mut().unwrap().max_attempts = 30;
    }
    client.register_saga_definition(&hold).await.unwrap();

    let cancelled = sagas::order(1, 1, 2, 1, 100);
    let timed = sagas::order(2, 2, 2, 2, 100);
    let a = client.start_saga(&start_of("hold", &cancelled)).await.unwrap().saga_id;
    let b = client
        .start_saga(&start_of("hold", &timed).with_deadline(Duration::from_millis(1_500)))
        .await
        .unwrap()
        .saga_id;
    let in_flight = |v: &pb::SagaView| {
        sagas::outcome(v.steps[0].forward.as_ref()) == pb::StepOutcome::Ok && v.steps[1].forward.is_some()
    };
    let va = wait_for(&client, a, Duration::from_secs(30), "step 1 in flight", in_flight).await;
    assert_eq!(sagas::state(&va), pb::SagaState::Running, "{va:#?}");

    // A wait that runs out is "still running", never a failure.
    match client.wait_saga(a, Duration::from_millis(300)).await.unwrap() {
        SagaWait::StillRunning { last: Some(v), .. } => {
            assert_eq!(sagas::state(&v), pb::SagaState::Running)
        }
        other => panic!("a short wait: {other:#?}"),
    }

    // Cancel: it stops going forward and compensates from the step in
    // flight; a repeat answers the same.
    let v = client.cancel_saga(a, "the customer called it off").await.unwrap();
    assert_eq!(sagas::state(&v), pb::SagaState::Compensating, "{v:#?}");
    assert_eq!(
        v.cancel_reason,
        format!(
            "cancelled by {}: the customer called it off",
            dtx_client::saga::CANCEL_WHO
        )
    );
    assert_eq!(v.current_step, 1, "the step in flight is settled first");
    let again = client.cancel_saga(a, "the customer called it off").await.unwrap();
    assert_eq!(again.operator_actions.len(), 1, "one cancel recorded: {again:#?}");

    // The deadline: the other saga is compensated as if cancelled.
    let vb = wait_for(&client, b, Duration::from_secs(30), "its deadline recorded", |v| {
        !v.cancel_reason.is_empty()
    })
    .await;
    assert!(vb.deadline_at_ms >= vb.started_at_ms + 1_500, "{vb:#?}");
    assert!(vb.cancel_reason.contains("deadline passed"), "{}", vb.cancel_reason);
    assert_ne!(sagas::state(&vb), pb::SagaState::Running, "{vb:#?}");

    // The payment service comes back: each forward call in flight is
    // asked about and fenced (never taken as failed, never charged), and
    // each reservation released.
    shop.start_role("payment").await;
    for id in [a, b] {
        let v = ends(&client, id, SagaEnd::Compensated).await;
        assert_ne!(
            sagas::outcome(v.steps[1].forward.as_ref()),
            pb::StepOutcome::Failed,
            "the call in flight is not taken as failed: {v:#?}"
        );
        assert_eq!(
            sagas::outcome(v.steps[1].compensation.as_ref()),
            pb::StepOutcome::Noop,
            "{v:#?}"
        );
        assert_eq!(
            sagas::outcome(v.steps[0].compensation.as_ref()),
            pb::StepOutcome::Ok,
            "{v:#?}"
        );
        assert!(!v.past_pivot);
    }

    // Past the pivot, a cancel is refused and the saga goes on.
    let paid = sagas::order(3, 3, 1, 3, 100);
    let p = client.start_saga(&start_of(ORDER, &paid)).await.unwrap().saga_id;
    wait_for(&client, p, Duration::from_secs(30), "past its pivot", |v| v.past_pivot).await;
    let e = client.cancel_saga(p, "too late").await.unwrap_err();
    match &e {
        ClientError::FailedPrecondition(m) => assert!(m.contains("pivot") && m.contains("cannot be cancelled"), "{m}"),
        other => panic!("a cancel past the pivot: {other:?}"),
    }
    shop.start_role("email").await;
    let v = ends(&client, p, SagaEnd::Completed).await;
    assert!(v.cancel_reason.is_empty() && v.operator_actions.is_empty(), "{v:#?}");

    let audits = shop.audit_all();
    let (inv, pay, provider) = (&audits[0], &audits[1], &audits[3]);
    for o in [&cancelled, &timed] {
        let r = &inv.reservations[&o.order];
        assert_eq!(
            (r.reserves_applied, r.releases_applied, r.reserved_qty),
            (1, 1, 0),
            "{}: reserved once, released once",
            o.order
        );
        assert!(
            pay.charges.get(&o.order).is_none_or(|c| c.charges_applied == 0),
            "{}: never charged",
            o.order
        );
        assert!(!provider.charges.contains_key(&o.order), "{}: no card charge", o.order);
    }
    assert_eq!(pay.charges[&paid.order].charges_applied, 1);
}
