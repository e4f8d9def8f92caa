//! The saga workload's checker (`--workload saga`): reads the starts, the
//! final journals (ListSagas after the settle wait) and the step services'
//! audits out of a history and decides:
//!
//! - duplicate forward actions: the audits' `duplicate_forward_actions`
//!   plus every order with more than one reserve, charge or confirmation
//!   applied: must be 0;
//! - duplicate compensations: an order whose reservation was released more
//!   than once: must be 0;
//! - lost sagas: a start answered with a saga id whose saga the cluster
//!   does not hold at the end, or a key answered with two saga ids;
//! - sagas not ended: still RUNNING or COMPENSATING after the settle wait;
//! - the business invariant: every COMPLETED order holds exactly one
//!   reservation (its quantity), one charge (its amount) and one
//!   confirmation; every COMPENSATED order holds no reservation, no charge
//!   and no confirmation; an order meant to fail (out of stock, unpayable)
//!   never COMPLETED; no order the audits know holds anything without a
//!   saga; the audits found no problem (stock and money conserved).
//! - the outside world (ADR 0034), from the payment provider's
//!   and the e-mail sender's own records (their audits, roles
//!   `payment-provider` and `email-sender`): no card charged and no e-mail
//!   sent twice for one order; a COMPLETED order's card charged once (its
//!   amount) and its confirmation e-mailed once; a COMPENSATED order's
//!   card never charged (`compensated_but_charged`) and nothing e-mailed;
//!   nothing charged or e-mailed for an order no saga holds. A run whose
//!   history lacks either audit is UNKNOWN, never VALID.
//!   PARKED sagas (manual escalations) are reported with their reasons, not
//!   invalid by themselves; their orders are left out of the per-order
//!   invariant (a note says so).
//!
//! And reports the UNKNOWN dwell time (from the journals: calls that were
//! UNKNOWN, their summed and longest `unknown_ms`) and the reconciliations.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::fmt::Write as _;

use dtx_saga_shop::Audit;
use serde::Deserialize;
use serde::Serialize;

use super::Validity;
use crate::history::Body;
use crate::history::Op;
use crate::history::OpType;
use crate::history::SagaEvent;
use crate::history::SagaSeen;

/// How many examples of each finding the text summary shows.
const EXAMPLES: usize = 5;
/// The outside world's audits: the payment provider's (cards charged) and
/// the e-mail sender's (e-mails sent).
pub const PROVIDER: &str = "payment-provider";
pub const SENDER: &str = "email-sender";
const OUTSIDE_ROLES: [&str; 2] = [PROVIDER, SENDER];
/// Every audit a complete history holds.
const AUDITED: [&str; 5] = ["inventory", "payment", "email", PROVIDER, SENDER];

/// The saga checker's findings.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct SagaReport {
    pub valid: Validity,
    /// Orders the clients tried to start, by kind (good, out-of-stock,
    /// unpayable).
    pub orders_tried: BTreeMap<String, u64>,
    /// Orders whose start was answered with a saga id.
    pub started: u64,
    /// Start calls answered UNKNOWN (each retried with the same key).
    pub start_unknown_answers: u64,
    /// Start calls refused (certainly not started).
    pub start_refused: u64,
    /// Orders never answered with a saga id (every try UNKNOWN or refused):
    /// could not start; of them, found started in the cluster anyway.
    pub could_not_start: u64,
    pub could_not_start_found: u64,
    /// Sagas the cluster holds at the end, by state.
    pub states: BTreeMap<String, u64>,
    /// PARKED sagas: (saga id, order, reason).
    pub parked: Vec<(u64, String, String)>,
    /// Sagas still RUNNING or COMPENSATING after the settle wait.
    pub not_ended: Vec<(u64, String, String)>,
    /// Started (with an id) but not held at the end, or a key with two ids.
    pub lost: Vec<String>,
    /// The audits' duplicate_forward_actions, summed.
    pub duplicate_forward_actions: u64,
    /// Orders with a forward effect applied more than once, with which.
    pub duplicate_forward_orders: Vec<String>,
    /// Orders whose reservation was released more than once.
    pub duplicate_compensations: Vec<String>,
    /// Per-order business invariant broken (one sentence each).
    pub invariant_violations: Vec<String>,
    /// The audits' `problems`, prefixed with the role.
    pub audit_problems: Vec<String>,
    /// COMPENSATED orders whose card the payment provider charged (the
    /// anomaly of ADR 0034): must be empty.
    #[serde(default)]
    pub compensated_but_charged: Vec<String>,
    /// Cards charged and e-mails sent, from the outside world's records;
    /// keys it voided (fenced before any request arrived) and charges it
    /// declined.
    #[serde(default)]
    pub cards_charged: u64,
    #[serde(default)]
    pub emails_sent: u64,
    #[serde(default)]
    pub outside_voided: u64,
    #[serde(default)]
    pub outside_declined: u64,
    /// Step-service operations still in flight at the end (UNKNOWN, their
    /// outside call unsettled: reported, never counted as failed).
    #[serde(default)]
    pub in_flight_at_end: u64,
    /// Good orders that ended COMPENSATED (not an anomaly by itself).
    pub good_compensated: u64,
    /// Journal calls in total, UNKNOWN ones, their dwell (ms).
    pub calls: u64,
    pub unknown_calls: u64,
    pub unknown_ms_sum: u64,
    pub unknown_ms_max: u64,
    /// Of the sagas with an UNKNOWN call, the median and the 99th
    /// percentile of their longest UNKNOWN time, ms (`unknown_ms` comes
    /// from the nodes' wall clocks: a skewed clock inflates the longest).
    pub unknown_ms_p50: u64,
    pub unknown_ms_p99: u64,
    pub reconciliations: u64,
    /// The step services' harmless repeats answered from their inboxes.
    pub forward_duplicates_seen: u64,
    pub compensate_duplicates_seen: u64,
    /// The settle wait after the final heal, ms.
    pub settle_ms: Option<u64>,
    /// Notes (orders left out of the invariant and why).
    pub notes: Vec<String>,
    /// Why some check could not be made (final reads or audits missing).
    pub unknown_reason: Option<String>,
}

/// What the starts said about one order.
#[derive(Default)]
struct Tried {
    kind: String,
    qty: u64,
    amount: u64,
    ids: BTreeSet<u64>,
}

pub fn check(history: &[Op]) -> SagaReport {
    let mut r = SagaReport::default();
    let mut tried: BTreeMap<String, Tried> = BTreeMap::new();
    let mut finals: Vec<&SagaSeen> = Vec::new();
    // Per role, every instance's audit merged (after `participant-gone`, the
    // gone service's and its replacement's), and how many instances.
    let mut audits: BTreeMap<String, Audit> = BTreeMap::new();
    let mut instances: BTreeMap<String, u64> = BTreeMap::new();
    let mut missing: Vec<String> = Vec::new();
    let mut settle_read = None;
    for op in history {
        let Body::Saga(ev) = &op.body else { continue };
        match ev {
            SagaEvent::Start {
                order,
                kind,
                qty,
                amount,
                saga_id,
                ..
            } => {
                let t = tried.entry(order.clone()).or_default();
                t.kind = kind.clone();
                t.qty = *qty;
                t.amount = *amount;
                match op.kind {
                    OpType::Invoke => {}
                    OpType::Ok => {
                        if let Some(id) = saga_id {
                            t.ids.insert(*id);
                        }
                    }
                    OpType::Info => r.start_unknown_answers += 1,
                    OpType::Fail => r.start_refused += 1,
                }
            }
            SagaEvent::Final(s) => finals.push(s),
            SagaEvent::Settle { waited_ms, read, .. } => {
                r.settle_ms = Some(*waited_ms);
                settle_read = Some(*read);
            }
            SagaEvent::Audit { role, audit, error } => match audit {
                Some(a) => {
                    *instances.entry(role.clone()).or_default() += 1;
                    match audits.get_mut(role) {
                        Some(into) => merge(into, a),
                        None => {
                            audits.insert(role.clone(), a.clone());
                        }
                    }
                }
                None => missing.push(format!(
                    "no audit of {role}: {}",
                    error.as_deref().unwrap_or("not recorded")
                )),
            },
        }
    }
    let mut unknown = missing;
    match settle_read {
        None => unknown.push("the final saga listing was not recorded".into()),
        Some(false) => unknown.push("the final saga listing could not be read".into()),
        Some(true) => {}
    }
    for role in AUDITED {
        if !audits.contains_key(role) && !unknown.iter().any(|u| u.contains(&format!("audit of {role}:"))) {
            unknown.push(format!("no audit of {role}"));
        }
    }

    // Starts.
    for t in tried.values() {
        *r.orders_tried.entry(t.kind.clone()).or_default() += 1;
    }
    let by_key: BTreeMap<&str, &SagaSeen> = finals.iter().map(|s| (s.key.as_str(), *s)).collect();
    let held_ids: BTreeSet<u64> = finals.iter().map(|s| s.saga_id).collect();
    let listing_read = settle_read == Some(true);
    for (order, t) in &tried {
        if t.ids.is_empty() {
            r.could_not_start += 1;
            if by_key.contains_key(order.as_str()) {
                r.could_not_start_found += 1;
            }
            continue;
        }
        r.started += 1;
        if t.ids.len() > 1 {
            r.lost.push(format!("order {order} answered with saga ids {:?}", t.ids));
        }
        if listing_read {
            for id in &t.ids {
                if !held_ids.contains(id) {
                    r.lost.push(format!(
                        "order {order}: saga {id} (start answered OK) not held at the end"
                    ));
                }
            }
            if let Some(s) = by_key.get(order.as_str()) {
                if !t.ids.contains(&s.saga_id) {
                    r.lost.push(format!(
                        "order {order}: held as saga {}, started as {:?}",
                        s.saga_id, t.ids
                    ));
                }
            }
        }
    }

    // Journals.
    let mut longest: Vec<u64> = finals
        .iter()
        .filter(|s| s.unknown_calls > 0)
        .map(|s| s.unknown_ms_max)
        .collect();
    longest.sort_unstable();
    let pct = |p: usize| {
        longest
            .get((longest.len() * p / 100).min(longest.len().saturating_sub(1)))
            .copied()
    };
    r.unknown_ms_p50 = pct(50).unwrap_or(0);
    r.unknown_ms_p99 = pct(99).unwrap_or(0);
    for s in &finals {
        *r.states.entry(s.state.clone()).or_default() += 1;
        r.calls += s.calls;
        r.unknown_calls += s.unknown_calls;
        r.unknown_ms_sum += s.unknown_ms_sum;
        r.unknown_ms_max = r.unknown_ms_max.max(s.unknown_ms_max);
        r.reconciliations += s.reconciliations;
        match s.state.as_str() {
            "COMPLETED" | "COMPENSATED" => {}
            "PARKED" => r.parked.push((s.saga_id, s.key.clone(), s.parked_reason.clone())),
            other => r.not_ended.push((s.saga_id, s.key.clone(), other.to_string())),
        }
    }

    // Audits.
    let empty = Audit::default();
    let inv = audits.get("inventory").unwrap_or(&empty);
    let pay = audits.get("payment").unwrap_or(&empty);
    let mail = audits.get("email").unwrap_or(&empty);
    let provider = audits.get(PROVIDER).unwrap_or(&empty);
    let sender = audits.get(SENDER).unwrap_or(&empty);
    r.cards_charged = provider.charges.values().map(|c| c.charges_applied).sum();
    r.emails_sent = sender.confirmations.values().map(|c| c.applied).sum();
    r.outside_voided = provider.outside_voided + sender.outside_voided;
    r.outside_declined = provider.outside_declined + sender.outside_declined;
    r.in_flight_at_end = audits
        .iter()
        .filter(|(role, _)| !OUTSIDE_ROLES.contains(&role.as_str()))
        .map(|(_, a)| a.in_flight)
        .sum();
    for (role, n) in instances.iter().filter(|(_, n)| **n > 1) {
        r.notes.push(format!(
            "{role}: {n} instances audited (one gone for good, and its replacement); their orders are merged"
        ));
    }
    for (role, a) in &audits {
        r.duplicate_forward_actions += a.duplicate_forward_actions;
        r.forward_duplicates_seen += a.forward_duplicates_seen;
        r.compensate_duplicates_seen += a.compensate_duplicates_seen;
        r.audit_problems
            .extend(a.problems.iter().map(|p| format!("{role}: {p}")));
    }
    let mut orders: BTreeSet<&str> = BTreeSet::new();
    orders.extend(inv.reservations.keys().map(String::as_str));
    orders.extend(pay.charges.keys().map(String::as_str));
    orders.extend(mail.confirmations.keys().map(String::as_str));
    orders.extend(provider.charges.keys().map(String::as_str));
    orders.extend(sender.confirmations.keys().map(String::as_str));
    for o in &orders {
        let res = inv.reservations.get(*o).cloned().unwrap_or_default();
        let ch = pay.charges.get(*o).cloned().unwrap_or_default();
        let conf = mail.confirmations.get(*o).cloned().unwrap_or_default();
        let card = provider.charges.get(*o).cloned().unwrap_or_default();
        let sent = sender.confirmations.get(*o).cloned().unwrap_or_default();
        let mut dup = Vec::new();
        if card.charges_applied > 1 {
            dup.push(format!("card charged {} times at the provider", card.charges_applied));
        }
        if sent.applied > 1 {
            dup.push(format!("{} e-mails sent", sent.applied));
        }
        if res.reserves_applied > 1 {
            dup.push(format!("{} reserves", res.reserves_applied));
        }
        if ch.charges_applied > 1 {
            dup.push(format!("{} charges", ch.charges_applied));
        }
        if conf.applied > 1 {
            dup.push(format!("{} confirmations", conf.applied));
        }
        if !dup.is_empty() {
            r.duplicate_forward_orders.push(format!("{o}: {}", dup.join(", ")));
        }
        if res.releases_applied > 1 {
            r.duplicate_compensations
                .push(format!("{o}: {} releases", res.releases_applied));
        }
    }

    // The business invariant, per order.
    let mut parked_orders = 0u64;
    let audits_complete = AUDITED.iter().all(|role| audits.contains_key(*role));
    if !(listing_read && audits_complete) {
        r.notes
            .push("the per-order invariant was not checked: the final listing or an audit is missing".into());
    }
    if listing_read && audits_complete {
        for (order, s) in &by_key {
            let res = inv.reservations.get(*order).cloned().unwrap_or_default();
            let ch = pay.charges.get(*order).cloned().unwrap_or_default();
            let conf = mail.confirmations.get(*order).cloned().unwrap_or_default();
            let card = provider.charges.get(*order).cloned().unwrap_or_default();
            let sent = sender.confirmations.get(*order).cloned().unwrap_or_default();
            let t = tried.get(*order);
            let kind = t.map(|t| t.kind.as_str()).unwrap_or("?");
            let mut broken = Vec::new();
            match s.state.as_str() {
                "COMPLETED" => {
                    if kind != "good" {
                        broken.push(format!("completed although {kind}"));
                    }
                    if res.reserves_applied != 1 || res.releases_applied != 0 || res.reserved_qty == 0 {
                        broken.push(format!(
                            "reservation: {} reserve(s), {} release(s), {} held",
                            res.reserves_applied, res.releases_applied, res.reserved_qty
                        ));
                    } else if let Some(t) = t.filter(|t| t.qty != res.reserved_qty) {
                        broken.push(format!("{} held for a quantity of {}", res.reserved_qty, t.qty));
                    }
                    if ch.charges_applied != 1 {
                        broken.push(format!("{} charge(s)", ch.charges_applied));
                    } else if let Some(t) = t.filter(|t| t.amount != ch.amount) {
                        broken.push(format!("charged {} for an amount of {}", ch.amount, t.amount));
                    }
                    if conf.applied != 1 {
                        broken.push(format!("{} confirmation(s)", conf.applied));
                    }
                    if card.charges_applied != 1 {
                        broken.push(format!("card charged {} time(s) at the provider", card.charges_applied));
                    } else if let Some(t) = t.filter(|t| t.amount != card.amount) {
                        broken.push(format!(
                            "card charged {} at the provider for an amount of {}",
                            card.amount, t.amount
                        ));
                    }
                    if sent.applied != 1 {
                        broken.push(format!("{} e-mail(s) sent", sent.applied));
                    }
                }
                "COMPENSATED" => {
                    if card.charges_applied != 0 {
                        r.compensated_but_charged.push(format!(
                            "order {order}: card charged {} time(s), {} in all, at the provider",
                            card.charges_applied, card.amount
                        ));
                        broken.push("its card is charged at the provider".into());
                    }
                    if sent.applied != 0 {
                        broken.push(format!("{} e-mail(s) sent", sent.applied));
                    }
                    if kind == "good" {
                        r.good_compensated += 1;
                    }
                    if res.reserved_qty != 0 {
                        broken.push(format!("{} still reserved", res.reserved_qty));
                    }
                    if ch.charges_applied != 0 || ch.amount != 0 {
                        broken.push(format!("{} charge(s) of {} held", ch.charges_applied, ch.amount));
                    }
                    if conf.applied != 0 {
                        broken.push(format!("{} confirmation(s)", conf.applied));
                    }
                }
                "PARKED" => parked_orders += 1,
                _ => {} // not ended: reported above
            }
            if !broken.is_empty() {
                r.invariant_violations
                    .push(format!("order {order} ({}): {}", s.state, broken.join("; ")));
            }
        }
        // Effects of an order no saga holds.
        for o in &orders {
            if by_key.contains_key(o) {
                continue;
            }
            let res = inv.reservations.get(*o).cloned().unwrap_or_default();
            let ch = pay.charges.get(*o).cloned().unwrap_or_default();
            let conf = mail.confirmations.get(*o).cloned().unwrap_or_default();
            let card = provider.charges.get(*o).cloned().unwrap_or_default();
            let sent = sender.confirmations.get(*o).cloned().unwrap_or_default();
            if res.reserved_qty != 0
                || ch.charges_applied != 0
                || conf.applied != 0
                || card.charges_applied != 0
                || sent.applied != 0
            {
                r.invariant_violations.push(format!(
                    "order {o} has no saga but holds {} reserved, {} charge(s), {} confirmation(s), {} card \
                     charge(s) and {} e-mail(s) in the outside world",
                    res.reserved_qty, ch.charges_applied, conf.applied, card.charges_applied, sent.applied
                ));
            }
        }
    }
    if parked_orders > 0 {
        r.notes.push(format!(
            "{parked_orders} PARKED order(s) left out of the per-order invariant (an operator decides them)"
        ));
    }

    let anomalies = r.duplicate_forward_actions > 0
        || !r.duplicate_forward_orders.is_empty()
        || !r.duplicate_compensations.is_empty()
        || !r.lost.is_empty()
        || !r.not_ended.is_empty()
        || !r.invariant_violations.is_empty()
        || !r.compensated_but_charged.is_empty()
        || !r.audit_problems.is_empty();
    if !unknown.is_empty() {
        r.unknown_reason = Some(unknown.join("; "));
    }
    r.valid = if anomalies {
        Validity::Invalid
    } else if r.unknown_reason.is_some() {
        Validity::Unknown
    } else {
        Validity::Valid
    };
    r
}

impl SagaReport {
    /// The text summary: the verdict first, then one line per finding.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        let _ = write!(out, "{}", self.valid.as_str().to_uppercase());
        if let Some(reason) = &self.unknown_reason {
            let _ = write!(out, " (incomplete: {reason})");
        }
        out.push('\n');
        let list = |out: &mut String, name: &str, items: &[String]| {
            let _ = write!(out, "{name}: {}", items.len());
            if !items.is_empty() {
                let ex: Vec<&str> = items.iter().take(EXAMPLES).map(String::as_str).collect();
                let _ = write!(out, " - {}", ex.join("; "));
            }
            out.push('\n');
        };
        let _ = writeln!(
            out,
            "orders tried: {} ({}); started {}, could not start {} (of them found started: {}); start answers UNKNOWN {}, refused {}",
            self.orders_tried.values().sum::<u64>(),
            self.orders_tried
                .iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect::<Vec<_>>()
                .join(", "),
            self.started,
            self.could_not_start,
            self.could_not_start_found,
            self.start_unknown_answers,
            self.start_refused
        );
        let _ = writeln!(
            out,
            "sagas at the end: {} ({}); good orders compensated: {}",
            self.states.values().sum::<u64>(),
            self.states
                .iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect::<Vec<_>>()
                .join(", "),
            self.good_compensated
        );
        let _ = writeln!(
            out,
            "duplicate forward actions: {} (audits) + {} order(s) with an effect applied twice",
            self.duplicate_forward_actions,
            self.duplicate_forward_orders.len()
        );
        list(
            &mut out,
            "  orders with duplicate forward effects",
            &self.duplicate_forward_orders,
        );
        list(&mut out, "duplicate compensations", &self.duplicate_compensations);
        let _ = writeln!(
            out,
            "UNKNOWN dwell: {} of {} call(s) were UNKNOWN, {} ms in all, longest {} ms (per saga: median {} ms, \
             p99 {} ms); reconciliations {}",
            self.unknown_calls,
            self.calls,
            self.unknown_ms_sum,
            self.unknown_ms_max,
            self.unknown_ms_p50,
            self.unknown_ms_p99,
            self.reconciliations
        );
        let _ = writeln!(
            out,
            "repeats answered from the step services' inboxes: {} forward, {} compensate",
            self.forward_duplicates_seen, self.compensate_duplicates_seen
        );
        let _ = writeln!(
            out,
            "outside world: {} card(s) charged, {} e-mail(s) sent, {} key(s) voided by a fence, {} declined; {} \
             step operation(s) still in flight at the end",
            self.cards_charged, self.emails_sent, self.outside_voided, self.outside_declined, self.in_flight_at_end
        );
        list(
            &mut out,
            "compensated orders whose card is charged",
            &self.compensated_but_charged,
        );
        let parked: Vec<String> = self
            .parked
            .iter()
            .map(|(id, k, why)| format!("saga {id} ({k}): {why}"))
            .collect();
        list(&mut out, "manual escalations (PARKED)", &parked);
        let not_ended: Vec<String> = self
            .not_ended
            .iter()
            .map(|(id, k, st)| format!("saga {id} ({k}) {st}"))
            .collect();
        list(&mut out, "sagas not ended after the settle", &not_ended);
        list(&mut out, "lost sagas", &self.lost);
        list(&mut out, "business invariant broken", &self.invariant_violations);
        list(&mut out, "audit problems", &self.audit_problems);
        if let Some(ms) = self.settle_ms {
            let _ = writeln!(out, "settle wait after the final heal: {ms} ms");
        }
        for n in &self.notes {
            let _ = writeln!(out, "note: {n}");
        }
        out
    }
}

/// Adds `a`, the audit of another instance of the same role (a step service
/// gone for good, or its replacement), into `into`. Orders are disjoint
/// between instances (each saga's definition version names one); an order
/// with effects at both is a problem. Skus and balances are each
/// instance's own (its `problems` say whether it conserved them).
fn merge(into: &mut Audit, a: &Audit) {
    into.inbox_forward += a.inbox_forward;
    into.inbox_compensate += a.inbox_compensate;
    into.forward_duplicates_seen += a.forward_duplicates_seen;
    into.compensate_duplicates_seen += a.compensate_duplicates_seen;
    into.outbox_pending += a.outbox_pending;
    into.in_flight += a.in_flight;
    into.outside_records += a.outside_records;
    into.outside_declined += a.outside_declined;
    into.outside_voided += a.outside_voided;
    into.duplicate_forward_actions += a.duplicate_forward_actions;
    into.problems.extend(a.problems.iter().cloned());
    let mut twice = Vec::new();
    for (k, v) in &a.reservations {
        if into.reservations.insert(k.clone(), v.clone()).is_some() {
            twice.push(k.clone());
        }
    }
    for (k, v) in &a.charges {
        if into.charges.insert(k.clone(), v.clone()).is_some() {
            twice.push(k.clone());
        }
    }
    for (k, v) in &a.confirmations {
        if into.confirmations.insert(k.clone(), v.clone()).is_some() {
            twice.push(k.clone());
        }
    }
    into.problems.extend(
        twice
            .into_iter()
            .map(|o| format!("order {o} has effects at two instances of {}", a.role)),
    );
}

#[cfg(test)]
mod tests {
    use dtx_saga_shop::ChargeAudit;
    use dtx_saga_shop::ConfirmationAudit;
    use dtx_saga_shop::ReservationAudit;

    use super::*;

    fn op(kind: OpType, ev: SagaEvent) -> Op {
        Op {
            index: 0,
            time_ns: 0,
            process: "client-0".into(),
            kind,
            txid: None,
            body: Body::Saga(ev),
            error: None,
        }
    }

    fn start(kind: OpType, order: &str, what: &str, id: Option<u64>) -> Op {
        op(
            kind,
            SagaEvent::Start {
                order: order.into(),
                kind: what.into(),
                qty: 2,
                amount: 30,
                attempt: 1,
                saga_id: id,
            },
        )
    }

    fn seen(id: u64, key: &str, state: &str) -> Op {
        op(
            OpType::Ok,
            SagaEvent::Final(SagaSeen {
                saga_id: id,
                key: key.into(),
                state: state.into(),
                calls: 3,
                unknown_calls: 1,
                unknown_ms_sum: 40,
                unknown_ms_max: 40,
                reconciliations: 1,
                ..SagaSeen::default()
            }),
        )
    }

    fn audit(role: &str, a: Audit) -> Op {
        op(
            OpType::Ok,
            SagaEvent::Audit {
                role: role.into(),
                audit: Some(a),
                error: None,
            },
        )
    }

    /// o-1 completed, o-2 compensated (unpayable), o-3 could not start.
    fn good_audits() -> (Audit, Audit, Audit) {
        let mut inv = Audit {
            role: "inventory".into(),
            ..Audit::default()
        };
        inv.reservations.insert(
            "o-1".into(),
            ReservationAudit {
                reserves_applied: 1,
                releases_applied: 0,
                reserved_qty: 2,
            },
        );
        inv.reservations.insert(
            "o-2".into(),
            ReservationAudit {
                reserves_applied: 1,
                releases_applied: 1,
                reserved_qty: 0,
            },
        );
        let mut pay = Audit {
            role: "payment".into(),
            ..Audit::default()
        };
        pay.charges.insert(
            "o-1".into(),
            ChargeAudit {
                charges_applied: 1,
                amount: 30,
            },
        );
        let mut mail = Audit {
            role: "email".into(),
            ..Audit::default()
        };
        mail.confirmations.insert(
            "o-1".into(),
            ConfirmationAudit {
                applied: 1,
                sent_lines: 2,
                sent_events: 1,
            },
        );
        (inv, pay, mail)
    }

    /// The outside world's audits for [`good_audits`]: o-1's card charged
    /// once, its confirmation e-mailed once.
    fn outside_audits() -> (Audit, Audit) {
        let mut provider = Audit {
            role: PROVIDER.into(),
            ..Audit::default()
        };
        provider.charges.insert(
            "o-1".into(),
            ChargeAudit {
                charges_applied: 1,
                amount: 30,
            },
        );
        let mut sender = Audit {
            role: SENDER.into(),
            ..Audit::default()
        };
        sender.confirmations.insert(
            "o-1".into(),
            ConfirmationAudit {
                applied: 1,
                sent_lines: 1,
                sent_events: 1,
            },
        );
        (provider, sender)
    }

    fn history(inv: Audit, pay: Audit, mail: Audit, o2_state: &str) -> Vec<Op> {
        let (provider, sender) = outside_audits();
        history_with(inv, pay, mail, provider, sender, o2_state)
    }

    fn history_with(inv: Audit, pay: Audit, mail: Audit, provider: Audit, sender: Audit, o2_state: &str) -> Vec<Op> {
        vec![
            start(OpType::Invoke, "o-1", "good", None),
            start(OpType::Ok, "o-1", "good", Some(1)),
            start(OpType::Invoke, "o-2", "unpayable", None),
            start(OpType::Ok, "o-2", "unpayable", Some(2)),
            start(OpType::Invoke, "o-3", "good", None),
            start(OpType::Info, "o-3", "good", None),
            seen(1, "o-1", "COMPLETED"),
            seen(2, "o-2", o2_state),
            op(
                OpType::Ok,
                SagaEvent::Settle {
                    waited_ms: 100,
                    all_ended: true,
                    read: true,
                },
            ),
            audit("inventory", inv),
            audit("payment", pay),
            audit("email", mail),
            audit(PROVIDER, provider),
            audit(SENDER, sender),
        ]
    }

    /// The anomaly of ADR 0034: the payment service recorded no charge (its
    /// call's reply was lost, it was fenced FAILED), the saga compensated,
    /// but the provider's own records hold the charge: INVALID.
    #[test]
    fn a_compensated_order_whose_card_the_provider_charged_is_invalid() {
        let (inv, pay, mail) = good_audits();
        let (mut provider, sender) = outside_audits();
        provider.charges.insert(
            "o-2".into(),
            ChargeAudit {
                charges_applied: 1,
                amount: 30,
            },
        );
        let r = check(&history_with(inv, pay, mail, provider, sender, "COMPENSATED"));
        assert_eq!(r.valid, Validity::Invalid, "{}", r.summary());
        assert_eq!(r.compensated_but_charged.len(), 1, "{}", r.summary());
        assert!(r.compensated_but_charged[0].starts_with("order o-2"));
        assert!(r.summary().contains("compensated orders whose card is charged: 1"));
        // A PARKED order is an operator's: reported, not invalid.
        let (inv, pay, mail) = good_audits();
        let (mut provider, sender) = outside_audits();
        provider.charges.insert("o-2".into(), ChargeAudit::default());
        let r = check(&history_with(inv, pay, mail, provider, sender, "PARKED"));
        assert_eq!(r.valid, Validity::Valid, "{}", r.summary());
    }

    #[test]
    fn a_card_charged_or_an_email_sent_twice_is_invalid() {
        let (inv, pay, mail) = good_audits();
        let (mut provider, sender) = outside_audits();
        provider.charges.get_mut("o-1").unwrap().charges_applied = 2;
        let r = check(&history_with(inv, pay, mail, provider, sender, "COMPENSATED"));
        assert_eq!(r.valid, Validity::Invalid);
        assert!(
            r.duplicate_forward_orders[0].contains("card charged 2 times"),
            "{}",
            r.summary()
        );
        let (inv, pay, mail) = good_audits();
        let (provider, mut sender) = outside_audits();
        sender.confirmations.get_mut("o-1").unwrap().applied = 2;
        let r = check(&history_with(inv, pay, mail, provider, sender, "COMPENSATED"));
        assert_eq!(r.valid, Validity::Invalid);
        assert!(r.duplicate_forward_orders[0].contains("2 e-mails"), "{}", r.summary());
    }

    #[test]
    fn a_completed_order_needs_its_card_charged_and_its_email_sent_once() {
        let (inv, pay, mail) = good_audits();
        let (mut provider, sender) = outside_audits();
        provider.charges.clear();
        let r = check(&history_with(inv, pay, mail, provider, sender, "COMPENSATED"));
        assert_eq!(r.valid, Validity::Invalid);
        assert!(
            r.invariant_violations[0].contains("card charged 0 time(s)"),
            "{}",
            r.summary()
        );
        let (inv, pay, mail) = good_audits();
        let (provider, mut sender) = outside_audits();
        sender.confirmations.clear();
        let r = check(&history_with(inv, pay, mail, provider, sender, "COMPENSATED"));
        assert_eq!(r.valid, Validity::Invalid);
        assert!(r.invariant_violations[0].contains("0 e-mail(s)"), "{}", r.summary());
        // A charge at the provider for an order no saga holds.
        let (inv, pay, mail) = good_audits();
        let (mut provider, sender) = outside_audits();
        provider.charges.insert(
            "o-9".into(),
            ChargeAudit {
                charges_applied: 1,
                amount: 1,
            },
        );
        let r = check(&history_with(inv, pay, mail, provider, sender, "COMPENSATED"));
        assert_eq!(r.valid, Validity::Invalid);
        assert!(r.invariant_violations[0].contains("o-9 has no saga"), "{}", r.summary());
    }

    #[test]
    fn a_missing_outside_audit_makes_the_verdict_unknown() {
        for role in [PROVIDER, SENDER] {
            let (inv, pay, mail) = good_audits();
            let mut h = history(inv, pay, mail, "COMPENSATED");
            h.retain(|o| !matches!(&o.body, Body::Saga(SagaEvent::Audit { role: r, .. }) if r == role));
            let r = check(&h);
            assert_eq!(r.valid, Validity::Unknown, "{}", r.summary());
            assert!(r.unknown_reason.as_deref().unwrap().contains(role), "{}", r.summary());
        }
    }

    #[test]
    fn a_clean_run_is_valid_and_counts_everything() {
        let (inv, pay, mail) = good_audits();
        let r = check(&history(inv, pay, mail, "COMPENSATED"));
        assert_eq!(r.valid, Validity::Valid, "{}", r.summary());
        assert_eq!(r.started, 2);
        assert_eq!(r.could_not_start, 1);
        assert_eq!(r.start_unknown_answers, 1);
        assert_eq!(r.states["COMPLETED"], 1);
        assert_eq!(r.states["COMPENSATED"], 1);
        assert_eq!((r.unknown_calls, r.unknown_ms_sum, r.unknown_ms_max), (2, 80, 40));
        assert_eq!(r.reconciliations, 2);
        assert!(r.summary().starts_with("VALID\n"), "{}", r.summary());
    }

    /// A step service gone for good (participant-gone) is audited with its
    /// replacement: their orders are merged and checked as one role's; an
    /// order with effects at both instances is a problem.
    #[test]
    fn a_gone_step_service_is_audited_with_its_replacement() {
        let (inv, pay, mail) = good_audits();
        // o-1's charge is at the gone instance; the replacement charged o-4,
        // whose saga is parked (left out of the per-order invariant).
        let mut replacement = Audit {
            role: "payment".into(),
            ..Audit::default()
        };
        replacement.charges.insert(
            "o-4".into(),
            ChargeAudit {
                charges_applied: 1,
                amount: 5,
            },
        );
        let mut h = history(inv.clone(), pay.clone(), mail.clone(), "COMPENSATED");
        h.insert(6, start(OpType::Ok, "o-4", "good", Some(4)));
        h.insert(7, seen(4, "o-4", "PARKED"));
        h.push(audit("payment", replacement.clone()));
        let r = check(&h);
        assert_eq!(r.valid, Validity::Valid, "{}", r.summary());
        assert!(
            r.notes.iter().any(|n| n.starts_with("payment: 2 instances")),
            "{:?}",
            r.notes
        );
        assert_eq!(r.parked.len(), 1);

        // Without the gone instance's audit, o-1 would hold no charge.
        let mut h = history(inv.clone(), replacement.clone(), mail.clone(), "COMPENSATED");
        h.insert(6, start(OpType::Ok, "o-4", "good", Some(4)));
        h.insert(7, seen(4, "o-4", "PARKED"));
        assert_eq!(check(&h).valid, Validity::Invalid);

        // The same order charged at both instances.
        let mut both = replacement;
        both.charges.insert(
            "o-1".into(),
            ChargeAudit {
                charges_applied: 1,
                amount: 30,
            },
        );
        let mut h = history(inv, pay, mail, "COMPENSATED");
        h.insert(6, start(OpType::Ok, "o-4", "good", Some(4)));
        h.insert(7, seen(4, "o-4", "PARKED"));
        h.push(audit("payment", both));
        let r = check(&h);
        assert_eq!(r.valid, Validity::Invalid);
        assert!(
            r.audit_problems
                .iter()
                .any(|p| p.contains("o-1 has effects at two instances")),
            "{}",
            r.summary()
        );
    }

    #[test]
    fn a_duplicate_forward_action_is_invalid() {
        let (mut inv, pay, mail) = good_audits();
        inv.reservations.get_mut("o-1").unwrap().reserves_applied = 2;
        let r = check(&history(inv, pay, mail.clone(), "COMPENSATED"));
        assert_eq!(r.valid, Validity::Invalid);
        assert_eq!(r.duplicate_forward_orders.len(), 1, "{}", r.summary());
        // The audit's own count alone is enough too.
        let (inv, mut pay, _) = good_audits();
        pay.duplicate_forward_actions = 1;
        let r = check(&history(inv, pay, mail, "COMPENSATED"));
        assert_eq!(r.valid, Validity::Invalid);
        assert_eq!(r.duplicate_forward_actions, 1);
    }

    #[test]
    fn a_duplicate_compensation_is_invalid() {
        let (mut inv, pay, mail) = good_audits();
        inv.reservations.get_mut("o-2").unwrap().releases_applied = 2;
        let r = check(&history(inv, pay, mail, "COMPENSATED"));
        assert_eq!(r.valid, Validity::Invalid);
        assert_eq!(r.duplicate_compensations.len(), 1, "{}", r.summary());
    }

    #[test]
    fn a_saga_not_ended_is_invalid_and_a_parked_one_only_reported() {
        let (inv, pay, mail) = good_audits();
        let r = check(&history(inv.clone(), pay.clone(), mail.clone(), "COMPENSATING"));
        assert_eq!(r.valid, Validity::Invalid);
        assert_eq!(r.not_ended.len(), 1);
        // PARKED with a reservation still held: reported, excluded, valid.
        let (mut inv, _, _) = good_audits();
        let res = inv.reservations.get_mut("o-2").unwrap();
        res.releases_applied = 0;
        res.reserved_qty = 2;
        let r = check(&history(inv, pay, mail, "PARKED"));
        assert_eq!(r.valid, Validity::Valid, "{}", r.summary());
        assert_eq!(r.parked.len(), 1);
        assert_eq!(r.notes.len(), 1);
    }

    #[test]
    fn a_lost_saga_is_invalid() {
        let (inv, pay, mail) = good_audits();
        let mut h = history(inv, pay, mail, "COMPENSATED");
        h.retain(|o| !matches!(&o.body, Body::Saga(SagaEvent::Final(s)) if s.saga_id == 2));
        // o-2's effects were released: only the lost saga is wrong.
        let r = check(&h);
        assert_eq!(r.valid, Validity::Invalid);
        assert_eq!(r.lost.len(), 1, "{}", r.summary());
    }

    #[test]
    fn a_broken_business_invariant_is_invalid() {
        // Completed without its confirmation.
        let (inv, pay, mut mail) = good_audits();
        mail.confirmations.clear();
        let r = check(&history(inv, pay, mail, "COMPENSATED"));
        assert_eq!(r.valid, Validity::Invalid);
        assert_eq!(r.invariant_violations.len(), 1, "{}", r.summary());
        // Compensated with the charge kept.
        let (inv, mut pay, mail) = good_audits();
        pay.charges.insert(
            "o-2".into(),
            ChargeAudit {
                charges_applied: 1,
                amount: 30,
            },
        );
        let r = check(&history(inv, pay, mail, "COMPENSATED"));
        assert_eq!(r.valid, Validity::Invalid);
        // Money or stock not conserved, per the audit.
        let (inv, mut pay, mail) = good_audits();
        pay.problems.push("c-1: balance 10 + charged 5 != initial 20".into());
        let r = check(&history(inv, pay, mail, "COMPENSATED"));
        assert_eq!(r.valid, Validity::Invalid);
        assert_eq!(r.audit_problems.len(), 1);
        // An unpayable order completed.
        let (inv, mut pay, mut mail) = good_audits();
        pay.charges.insert(
            "o-2".into(),
            ChargeAudit {
                charges_applied: 1,
                amount: 30,
            },
        );
        mail.confirmations.insert(
            "o-2".into(),
            ConfirmationAudit {
                applied: 1,
                sent_lines: 1,
                sent_events: 1,
            },
        );
        let (mut inv2, _, _) = good_audits();
        *inv2.reservations.get_mut("o-2").unwrap() = inv.reservations["o-1"].clone();
        let r = check(&history(inv2, pay, mail, "COMPLETED"));
        assert_eq!(r.valid, Validity::Invalid);
        assert!(
            r.invariant_violations[0].contains("completed although unpayable"),
            "{}",
            r.summary()
        );
    }

    #[test]
    fn missing_audits_or_listing_make_the_verdict_unknown() {
        let (inv, pay, mail) = good_audits();
        let mut h = history(inv, pay, mail, "COMPENSATED");
        h.retain(|o| !matches!(&o.body, Body::Saga(SagaEvent::Audit { role, .. }) if role == "email"));
        let r = check(&h);
        assert_eq!(r.valid, Validity::Unknown, "{}", r.summary());
    }
}
