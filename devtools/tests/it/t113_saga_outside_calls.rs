//! Outside calls in flight (ADR 0034), end to end: a real three-node cluster,
//! the order saga's step services and the outside world they call (the
//! payment provider and the e-mail sender), all real processes. The charge is
//! an outside call: recorded in flight before it leaves, with the operation
//! id as the provider's idempotency key, and settled only by asking the
//! provider.
//!
//! ADR 0034's scenario: the provider charges, its reply times out, the
//! charge errors. Before ADR 0034 the payment service recorded nothing
//! (its handler's error rolled its transaction back), so every status
//! query said "not applied", the last attempt was fenced FAILED, the stock
//! was released and the saga ended COMPENSATED with the card charged. Now
//! the status query asks the provider, which says charged: the saga
//! completes and the card is charged once.

use crate::common;

use std::time::Duration;
use std::time::Instant;

use common::sagas;
use common::sagas::SagaShop;
use common::sagas::ShopFlags;
use common::sagas::ENDED;
use common::TestCluster;
use dtx_proto::v1 as pb;

const ORDER: &str = dtx_saga_shop::ORDER_SAGA;

async fn ready(name: &str, flags: ShopFlags) -> (TestCluster, SagaShop) {
    let mut c = TestCluster::start(name);
    c.leader().await;
    let shop = SagaShop::start(c.dir.path(), flags).await;
    sagas::register(&c, shop.definition()).await;
    (c, shop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t113_charges_whose_replies_are_all_lost_complete_and_are_charged_once() {
    // The provider loses every reply to the payment service, after it
    // charged (or declined) and recorded it.
    let (c, mut shop) = ready(
        "t113a",
        ShopFlags {
            provider_lose_replies_percent: 100,
            ..ShopFlags::default()
        },
    )
    .await;
    let good: Vec<_> = (1..=4).map(|i| sagas::order(i, i as u32, 1, i as u32, 250)).collect();
    let unpayable = sagas::order(5, 5, 1, 5, 10_000_000);
    let mut ids = Vec::new();
    for o in good.iter().chain([&unpayable]) {
        ids.push(sagas::start(&c, ORDER, o, None).await);
    }
    let mut views = Vec::new();
    for id in &ids {
        views.push(sagas::wait_state(&c, &mut shop, *id, &ENDED, Duration::from_secs(90)).await);
    }
    for v in &views[..4] {
        assert_eq!(
            sagas::state(v),
            pb::SagaState::Completed,
            "a charged card must never end compensated: {v:#?}"
        );
        let charge = v.steps[1].forward.as_ref().unwrap();
        assert_eq!(sagas::outcome(Some(charge)), pb::StepOutcome::Ok);
        assert!(
            charge.reconciliations >= 1,
            "the lost reply was settled by the status query, which asked the provider: {v:#?}"
        );
        assert!(
            charge.downstream_operation_id.starts_with("ch-"),
            "the journal names the provider's charge: {charge:#?}"
        );
    }
    // Declined, and that reply lost too: settled the same way, FAILED,
    // compensated, the card never charged.
    let v = &views[4];
    assert_eq!(sagas::state(v), pb::SagaState::Compensated, "{v:#?}");
    let charge = v.steps[1].forward.as_ref().unwrap();
    assert_eq!(sagas::outcome(Some(charge)), pb::StepOutcome::Failed);
    assert!(charge.reason.contains("insufficient funds"), "{charge:#?}");
    assert_eq!(sagas::outcome(v.steps[0].compensation.as_ref()), pb::StepOutcome::Ok);

    let audits = shop.audit_all();
    let (pay, provider, sender) = (&audits[1], &audits[3], &audits[4]);
    for o in &good {
        let card = &provider.charges[&o.order];
        assert_eq!((card.charges_applied, card.amount), (1, o.amount), "{o:?}");
        assert_eq!(pay.charges[&o.order].charges_applied, 1);
        assert_eq!(sender.confirmations[&o.order].applied, 1);
    }
    assert!(
        !provider.charges.contains_key(&unpayable.order),
        "the compensated order's card is not charged: {provider:#?}"
    );
    assert_eq!(pay.in_flight, 0, "every charge settled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t113_an_unreachable_provider_keeps_the_charge_unknown_never_compensated() {
    // The provider is down when the charge is sent: the payment service
    // cannot tell whether it arrived (a connection refused, a timeout: the
    // same to it), so the charge is in flight and its status query cannot
    // be answered. The saga waits (never FAILED, never compensated) until
    // the provider answers again, then completes, charged once.
    let (c, mut shop) = ready("t113b", ShopFlags::default()).await;
    shop.outside("payment").kill9();
    let o = sagas::order(1, 1, 1, 1, 400);
    let id = sagas::start(&c, ORDER, &o, None).await;
    let until = Instant::now() + Duration::from_secs(4);
    let mut saw_unknown = false;
    while Instant::now() < until {
        let v = sagas::get(&c, id).await;
        assert_eq!(
            sagas::state(&v),
            pb::SagaState::Running,
            "while the provider cannot tell, the saga neither fails nor compensates: {v:#?}"
        );
        assert!(v.steps[0].compensation.is_none(), "{v:#?}");
        if sagas::outcome(v.steps[1].forward.as_ref()) == pb::StepOutcome::Unknown {
            saw_unknown = true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(saw_unknown, "the charge was UNKNOWN while the provider was away");
    shop.outside("payment").start(&[]).unwrap();
    shop.outside("payment").wait_started().await.unwrap();
    let v = sagas::wait_state(&c, &mut shop, id, &ENDED, Duration::from_secs(60)).await;
    assert_eq!(sagas::state(&v), pb::SagaState::Completed, "{v:#?}");
    let audits = shop.audit_all();
    let provider = &audits[3];
    assert_eq!(provider.charges[&o.order].charges_applied, 1, "{provider:#?}");
    assert_eq!(audits[1].in_flight, 0);
}
