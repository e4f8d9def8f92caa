//! The three step handlers of the order saga, on the SDK's
//! [`participant_sdk::saga`] store. Every one reads the same input
//! ([`OrderInput`]) and keeps, besides its business data, a count of the
//! business effects applied per order (`effects/<what>/<order>`), never
//! decremented: only the operation id de-duplicates (there is no
//! de-duplication by order here on purpose), so an order whose effect was
//! applied twice is a duplicate forward action the audit reports. The
//! payment and e-mail services do their business outside (the payment
//! provider's charge, the e-mail sender's message: [`crate::outside`]) and
//! record here what it answered.

use participant_sdk::saga::CallKind;
use participant_sdk::saga::OutsideSystem;
use participant_sdk::saga::StepCall;
use participant_sdk::saga::StepHandler;
use participant_sdk::saga::StepResult;
use participant_sdk::saga::StepStaged;
use participant_sdk::saga::StepView;
use serde::Deserialize;
use serde::Serialize;

use crate::outside::OutsideAnswer;
use crate::outside::OutsideClient;
use crate::outside::Work;
use crate::OrderInput;
use crate::Seed;

/// Present once a service's data was seeded.
pub(crate) const SEEDED_KEY: &[u8] = b"seeded";

pub(crate) fn sku_key(sku: &str) -> Vec<u8> {
    format!("sku/{sku}").into_bytes()
}

/// A reservation, charge or confirmation of `order` made by forward
/// operation `op`.
pub(crate) fn effect_key(what: &str, order: &str, op: &str) -> Vec<u8> {
    format!("{what}/{order}/{op}").into_bytes()
}

/// How many times `what` (reserve, release, charge, confirm) was applied
/// for `order`.
pub(crate) fn count_key(what: &str, order: &str) -> Vec<u8> {
    format!("effects/{what}/{order}").into_bytes()
}

pub(crate) fn read_json<T: for<'de> Deserialize<'de>>(view: &StepView<'_>, key: &[u8]) -> Option<T> {
    view.get(key)
        .ok()
        .flatten()
        .and_then(|v| serde_json::from_slice(&v).ok())
}

fn put_json<T: Serialize>(staged: &mut StepStaged, key: &[u8], v: &T) {
    staged.put(key, &serde_json::to_vec(v).expect("serializable"));
}

pub(crate) fn read_count(view: &StepView<'_>, key: &[u8]) -> u64 {
    view.get(key)
        .ok()
        .flatten()
        .and_then(|v| std::str::from_utf8(&v).ok()?.parse().ok())
        .unwrap_or(0)
}

fn bump_count(view: &StepView<'_>, staged: &mut StepStaged, what: &str, order: &str) {
    let key = count_key(what, order);
    let n = read_count(view, &key) + 1;
    staged.put(&key, n.to_string().as_bytes());
}

fn input(call: &StepCall) -> Result<OrderInput, StepResult> {
    serde_json::from_slice(&call.input).map_err(|e| StepResult::failed(format!("the input is not an order: {e}")))
}

/// One sku: `stock + reserved == initial` always.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SkuRecord {
    pub initial: u64,
    pub stock: u64,
    pub reserved: u64,
    /// Changes with every reserve and release of the sku: the resource
    /// version a reserve reports.
    pub version: u64,
}

/// What one reserve holds for an order.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReservationRecord {
    pub sku: String,
    pub qty: u64,
    /// The sku's version at the reservation's last change (the reserve's):
    /// what a release's precondition must name.
    pub version: u64,
}

/// A charge the payment provider made for an order (its answer).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ChargeRecord {
    pub customer: String,
    pub amount: u64,
    /// The provider's id of the charge.
    #[serde(default)]
    pub charge_id: String,
}

pub(crate) fn sku_name(i: u32) -> String {
    format!("sku-{i}")
}

/// The inventory: action [`crate::RESERVE`] (COMPENSABLE, versioned),
/// compensation [`crate::RELEASE`], status query [`crate::RESERVATION`].
///
/// The version rule of a release: a reservation's version is the sku's
/// version when the reservation last changed, which is the version its
/// reserve reported unless someone changed the reservation since (which
/// moves the sku's version on too). A release whose precondition is not
/// the reservation's version is STALE and changes nothing. Other orders'
/// reserves and releases of the same sku move the sku's version but not
/// this reservation's, so they do not make a release stale.
#[derive(Clone, Debug, Default)]
pub struct Inventory;

impl Inventory {
    pub(crate) fn seed(seed: &Seed, staged: &mut StepStaged) {
        for i in 0..seed.skus {
            let rec = SkuRecord {
                initial: seed.stock,
                stock: seed.stock,
                reserved: 0,
                version: 0,
            };
            put_json(staged, &sku_key(&sku_name(i)), &rec);
        }
    }
}

impl StepHandler for Inventory {
    fn forward(&self, view: &StepView<'_>, call: &StepCall, staged: &mut StepStaged) -> StepResult {
        if call.action == crate::AMEND {
            return amend(view, call, staged);
        }
        if call.action != crate::RESERVE {
            return StepResult::failed(format!("the inventory has no action {:?}", call.action));
        }
        let o = match input(call) {
            Ok(o) => o,
            Err(r) => return r,
        };
        let Some(mut sku) = read_json::<SkuRecord>(view, &sku_key(&o.sku)) else {
            return StepResult::failed(format!("unknown sku {:?}", o.sku));
        };
        if sku.stock < o.qty {
            return StepResult::failed("out of stock");
        }
        sku.stock -= o.qty;
        sku.reserved += o.qty;
        sku.version += 1;
        put_json(staged, &sku_key(&o.sku), &sku);
        let resv = ReservationRecord {
            sku: o.sku.clone(),
            qty: o.qty,
            version: sku.version,
        };
        put_json(staged, &effect_key("reservation", &o.order, &call.operation_id), &resv);
        bump_count(view, staged, "reserve", &o.order);
        StepResult::ok(sku.version.to_string())
    }

    fn compensate(&self, view: &StepView<'_>, call: &StepCall, staged: &mut StepStaged) -> StepResult {
        if call.action != crate::RELEASE {
            return StepResult::failed(format!("the inventory has no compensation {:?}", call.action));
        }
        let o = match input(call) {
            Ok(o) => o,
            Err(r) => return r,
        };
        let key = effect_key("reservation", &o.order, &call.forward_operation_id);
        let Some(resv) = read_json::<ReservationRecord>(view, &key) else {
            return StepResult::noop(format!(
                "no reservation of order {} by {} is held (released before)",
                o.order, call.forward_operation_id
            ));
        };
        if let Err(stale) = call.check_precondition(&resv.version.to_string()) {
            return match stale {
                StepResult::Stale { reason, .. } => StepResult::Stale {
                    reason,
                    residual: format!("{} of {} stay reserved for order {}", resv.qty, resv.sku, o.order),
                },
                other => other,
            };
        }
        let Some(mut sku) = read_json::<SkuRecord>(view, &sku_key(&resv.sku)) else {
            return StepResult::failed(format!("unknown sku {:?}", resv.sku));
        };
        sku.stock += resv.qty;
        sku.reserved = sku.reserved.saturating_sub(resv.qty);
        sku.version += 1;
        put_json(staged, &sku_key(&resv.sku), &sku);
        staged.delete(&key);
        bump_count(view, staged, "release", &o.order);
        StepResult::ok(sku.version.to_string())
    }

    fn knows_query(&self, query: &str) -> bool {
        query == crate::RESERVATION
    }
}

/// [`crate::AMEND`]: a newer, legitimate change to an order's reservation
/// made outside the saga (customer service changes the quantity to the
/// input's `qty`). It moves the sku's version on and records it as the
/// reservation's, so a later release planned on the reserve's version is
/// STALE: the saga's compensation never erases this change.
fn amend(view: &StepView<'_>, call: &StepCall, staged: &mut StepStaged) -> StepResult {
    let o = match input(call) {
        Ok(o) => o,
        Err(r) => return r,
    };
    let prefix = format!("reservation/{}/", o.order);
    let held = match view.scan(prefix.as_bytes()) {
        Ok(v) => v,
        Err(e) => return StepResult::failed(format!("cannot read the reservations: {e}")),
    };
    let Some((key, v)) = held.into_iter().next() else {
        return StepResult::failed(format!("order {} holds no reservation", o.order));
    };
    let Ok(mut resv) = serde_json::from_slice::<ReservationRecord>(&v) else {
        return StepResult::failed("a reservation record does not decode");
    };
    let Some(mut sku) = read_json::<SkuRecord>(view, &sku_key(&resv.sku)) else {
        return StepResult::failed(format!("unknown sku {:?}", resv.sku));
    };
    // Give back the old quantity, take the new one.
    let available = sku.stock + resv.qty;
    if available < o.qty {
        return StepResult::failed("out of stock");
    }
    sku.stock = available - o.qty;
    sku.reserved = sku.reserved - resv.qty + o.qty;
    sku.version += 1;
    resv.qty = o.qty;
    resv.version = sku.version;
    put_json(staged, &sku_key(&resv.sku), &sku);
    put_json(staged, &key, &resv);
    StepResult::ok(sku.version.to_string())
}

/// The payment service: action [`crate::CHARGE`] (PIVOT: no
/// compensation), status query [`crate::CHARGE_STATUS`]. A charge is an
/// outside call (ADR 0034) to the payment provider
/// ([`crate::outside`], its own process): the store records it in flight,
/// sends [`Work::Charge`] under the operation id as idempotency key, and
/// [`StepHandler::finish_outside`] records the provider's answer here
/// (the charge id, and the count of charges per order). The accounts and
/// their balances are the provider's. Its own gRPC replies can be lost
/// too (`--lose-replies-percent`, [`crate::LosingReplies`]).
#[derive(Clone, Debug, Default)]
pub struct Payment {
    /// The provider; `None` only to audit a stopped service's data.
    pub provider: Option<OutsideClient>,
}

impl StepHandler for Payment {
    fn forward(&self, _view: &StepView<'_>, call: &StepCall, _staged: &mut StepStaged) -> StepResult {
        StepResult::failed(format!("the payment service has no action {:?}", call.action))
    }

    fn compensate(&self, _view: &StepView<'_>, call: &StepCall, _staged: &mut StepStaged) -> StepResult {
        StepResult::failed(format!(
            "a charge is the pivot and has no compensation (asked for {:?})",
            call.action
        ))
    }

    fn knows_query(&self, query: &str) -> bool {
        query == crate::CHARGE_STATUS
    }

    fn outside(&self) -> Option<&dyn OutsideSystem> {
        self.provider.as_ref().map(|p| p as &dyn OutsideSystem)
    }

    fn outside_request(
        &self,
        _view: &StepView<'_>,
        kind: CallKind,
        call: &StepCall,
    ) -> Result<Option<Vec<u8>>, StepResult> {
        if kind != CallKind::Forward || call.action != crate::CHARGE {
            return Ok(None);
        }
        let o = input(call)?;
        Ok(Some(
            Work::Charge {
                customer: o.customer,
                amount: o.amount,
                order: o.order,
            }
            .to_json(),
        ))
    }

    fn finish_outside(
        &self,
        view: &StepView<'_>,
        _kind: CallKind,
        call: &StepCall,
        answer: &[u8],
        staged: &mut StepStaged,
    ) -> StepResult {
        match OutsideAnswer::from_json(answer) {
            Ok(OutsideAnswer::Charged {
                charge_id,
                customer,
                amount,
                order,
            }) => {
                let charge = ChargeRecord {
                    customer,
                    amount,
                    charge_id: charge_id.clone(),
                };
                put_json(staged, &effect_key("charge", &order, &call.operation_id), &charge);
                bump_count(view, staged, "charge", &order);
                StepResult::Ok {
                    resource_version: String::new(),
                    downstream_operation_id: charge_id,
                    residual: String::new(),
                    output: Vec::new(),
                }
            }
            Ok(OutsideAnswer::Declined { reason }) => StepResult::failed(format!("declined: {reason}")),
            Ok(OutsideAnswer::Voided) => {
                StepResult::failed("the payment provider voided this charge's key: it was never charged")
            }
            Ok(other) => StepResult::failed(format!("the payment provider answered {other:?}")),
            Err(e) => StepResult::failed(e),
        }
    }
}

/// The e-mail service: action [`crate::SEND_CONFIRMATION`] (RETRIABLE),
/// status query [`crate::EMAIL_STATUS`]. A confirmation is an outside
/// call (ADR 0034) to the e-mail sender ([`crate::outside`], its own
/// process), like a charge; this service records the sender's answer
/// (the message id, and the count of confirmations per order). With
/// `fail_first_percent` it answers FAILED "mail server busy" that often,
/// before sending anything (the orchestrator retries under a new
/// operation id).
#[derive(Clone, Debug, Default)]
pub struct Email {
    pub fail_first_percent: u32,
    /// The sender; `None` only to audit a stopped service's data.
    pub sender: Option<OutsideClient>,
}

/// The text of `order`'s confirmation e-mail.
pub fn confirmation_event(order: &str) -> String {
    format!("confirmation for order {order}")
}

impl StepHandler for Email {
    fn forward(&self, _view: &StepView<'_>, call: &StepCall, _staged: &mut StepStaged) -> StepResult {
        StepResult::failed(format!("the e-mail service has no action {:?}", call.action))
    }

    fn compensate(&self, _view: &StepView<'_>, call: &StepCall, _staged: &mut StepStaged) -> StepResult {
        StepResult::failed(format!(
            "a confirmation is retriable and has no compensation (asked for {:?})",
            call.action
        ))
    }

    fn knows_query(&self, query: &str) -> bool {
        query == crate::EMAIL_STATUS
    }

    fn outside(&self) -> Option<&dyn OutsideSystem> {
        self.sender.as_ref().map(|s| s as &dyn OutsideSystem)
    }

    fn outside_request(
        &self,
        _view: &StepView<'_>,
        kind: CallKind,
        call: &StepCall,
    ) -> Result<Option<Vec<u8>>, StepResult> {
        if kind != CallKind::Forward || call.action != crate::SEND_CONFIRMATION {
            return Ok(None);
        }
        if self.fail_first_percent > 0 && rand::random_range(0..100u32) < self.fail_first_percent {
            return Err(StepResult::failed("mail server busy"));
        }
        let o = input(call)?;
        Ok(Some(
            Work::Send {
                to: o.customer,
                text: confirmation_event(&o.order),
                order: o.order,
            }
            .to_json(),
        ))
    }

    fn finish_outside(
        &self,
        view: &StepView<'_>,
        _kind: CallKind,
        call: &StepCall,
        answer: &[u8],
        staged: &mut StepStaged,
    ) -> StepResult {
        match OutsideAnswer::from_json(answer) {
            Ok(OutsideAnswer::Sent { message_id, order, .. }) => {
                staged.put(
                    &effect_key("confirmation", &order, &call.operation_id),
                    message_id.as_bytes(),
                );
                bump_count(view, staged, "confirm", &order);
                StepResult::Ok {
                    resource_version: String::new(),
                    downstream_operation_id: message_id,
                    residual: String::new(),
                    output: Vec::new(),
                }
            }
            Ok(OutsideAnswer::Voided) => {
                StepResult::failed("the e-mail sender voided this confirmation's key: it was never sent")
            }
            Ok(other) => StepResult::failed(format!("the e-mail sender answered {other:?}")),
            Err(e) => StepResult::failed(e),
        }
    }
}
