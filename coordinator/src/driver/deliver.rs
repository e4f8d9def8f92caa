//! Phase two: delivering a recorded decision to every participant that has
//! not acked it, until each one acks, this node stops leading the term the
//! delivery started in, or the transaction is forgotten.
//!
//! One task per transaction (`Driver::spawn_delivery`, held to one per
//! txid by its `Delivering` mark), and in it one delivery per unacked
//! participant ([`Delivery`]), which loops:
//! 1. [`Delivery::wanted`]: still the leader of its term, the participant
//!    still unacked (and the decision the same, invariant 4);
//! 2. [`Delivery::next_step`]: asks the owner for its turn at the address
//!    (`book::Book::next_turn`: the health record's slot or probe turn, the
//!    give-up rule), and waits, parked, when there is none;
//! 3. [`Delivery::attempt`]: one item of an ApplyDecisions message
//!    (`phase_two`), reported to the owner, then the ack through Raft.
//!
//! Its mark ([`super::owner::DeliveryMark`]) tells the owner when it ends,
//! however it ends: a call it had out frees its slot, a probe turn it held
//! passes on, its attempts stop being shown.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use dtx_proto::v1 as pb;
use dtx_tls::logtext::clean;
use dtx_tls::logtext::Clean;
use rand::Rng;
use tracing::warn;
use tracing::Instrument;

use super::answer::DeliveryError;
use super::book::doing;
use super::book::Attempt;
use super::book::ErrorClass;
use super::book::Step;
use super::book::Work;
use super::health;
use super::owner::DeliveryMark;
use super::owner::Msg;
use super::txn_span;
use super::Driver;
use crate::sm::Outcome;
use crate::sm::Participant;
use crate::sm::Txid;

/// The longest a parked delivery waits before it looks at its leadership
/// and its record again (it is normally woken sooner: by a freed slot, a
/// free probe turn, the participant answering again, or a new term).
const PARKED_MAX: Duration = Duration::from_secs(10);

impl Driver {
    /// Starts phase two for `txid` unless it is already running here.
    pub fn spawn_delivery(self: &Arc<Self>, txid: Txid) {
        let driver = self.clone();
        tokio::spawn(
            async move {
                let Some(_mark) = driver.claim(Work::Delivering, txid).await else {
                    return;
                };
                driver.deliver(txid).await;
            }
            .instrument(txn_span("deliver", txid)),
        );
    }

    /// Delivers the recorded decision of `txid` to every participant that
    /// has not acked it, in parallel.
    async fn deliver(&self, txid: Txid) {
        let term = self.ctx.current_term();
        let (outcome, pending) = {
            let st = self.ctx.sm.state();
            let Some(r) = st.table.get(txid) else { return };
            let Some(d) = r.decision() else { return };
            // Not to a participant an operator dropped (gone for good).
            let pending: Vec<Participant> = r
                .participants
                .iter()
                .filter(|p| st.table.awaiting_ack(txid, &p.id))
                .cloned()
                .collect();
            (d.outcome, pending)
        };
        self.saw_decision(txid, outcome);
        futures::future::join_all(
            pending
                .iter()
                .map(|p| Delivery::new(self, txid, term, outcome, p).run()),
        )
        .await;
    }

    /// The backoff after `failures` failures, with equal jitter.
    pub(super) fn backoff(&self, failures: u32) -> Duration {
        let t = &self.ctx.config.txn;
        let u = rand::rng().random_range(0.0..=1.0);
        health::backoff(
            Duration::from_millis(t.delivery_retry_base_ms),
            Duration::from_millis(t.delivery_retry_max_ms),
            failures.saturating_add(1),
            u,
        )
    }

    /// Says that `p`'s calls in `txid` were given up (ADR 0041): counted,
    /// logged once per address per summary interval. The owner marked them
    /// given up, shown to operators with the last error.
    pub(super) fn log_given_up(&self, txid: Txid, p: &Participant, what: health::Retried) {
        let bound_ms = self.ctx.config.txn.never_answered_give_up_ms;
        let kind = match what {
            health::Retried::OnePhaseCommit => "one_phase_commit",
            _ => "abort_delivery",
        };
        metrics::counter!("dtx_never_answered_given_up_total", "kind" => kind).increment(1);
        let address = clean(&p.address);
        if let Some(held) = self.given_up_log.note(&address) {
            warn!(
                txid,
                participant = %Clean(&p.id),
                address = %address,
                held_back = held,
                "stopped {}: the address never answered this leader within {bound_ms} ms \
                 (txn.never_answered_give_up_ms); an operator drops the participant or resolves the transaction",
                doing(what)
            );
        }
    }

    /// One Commit or Abort call of its own, for a participant that does
    /// not serve ApplyDecisions.
    pub(super) async fn send_decision(
        &self,
        txid: Txid,
        term: u64,
        outcome: Outcome,
        p: &Participant,
    ) -> Result<(), DeliveryError> {
        let ch = self.ctx.api_channel(&p.address).map_err(|e| DeliveryError::Refused {
            message: format!("bad participant address {:?}: {e}", p.address),
            stale_term: false,
        })?;
        let mut client = self.ctx.participant_over(ch);
        let body = pb::ParticipantDecisionRequest {
            txid,
            term,
            participant_id: p.id.clone(),
            incarnation: self.ctx.incarnation_of(txid),
        };
        let timeout = Duration::from_millis(self.ctx.config.txn.prepare_timeout_ms);
        let mut req = tonic::Request::new(body);
        req.set_timeout(timeout);
        self.mark_call(txid, &mut req).await;
        let call = async {
            match outcome {
                Outcome::Commit => client.commit(req).await,
                Outcome::Abort => client.abort(req).await,
            }
        };
        match tokio::time::timeout(timeout, call).await {
            Err(_) => Err(DeliveryError::NoAnswer(format!(
                "no answer within {} ms",
                timeout.as_millis()
            ))),
            Ok(Err(s)) => Err(DeliveryError::from_status(&s)),
            Ok(Ok(r)) if r.get_ref().applied => Ok(()),
            Ok(Ok(_)) => Err(DeliveryError::Refused {
                message: "participant answered applied = false".into(),
                stale_term: false,
            }),
        }
    }
}

/// One participant's phase two in one transaction.
struct Delivery<'a> {
    driver: &'a Driver,
    txid: Txid,
    /// The term it started in: it delivers only while this node leads it
    /// (invariant 9).
    term: u64,
    outcome: Outcome,
    p: &'a Participant,
    /// What the give-up rule calls this work.
    retried: health::Retried,
    /// Refusals in a row (each backs off longer).
    refusals: u32,
    mark: DeliveryMark,
}

impl<'a> Delivery<'a> {
    fn new(driver: &'a Driver, txid: Txid, term: u64, outcome: Outcome, p: &'a Participant) -> Self {
        Delivery {
            driver,
            txid,
            term,
            outcome,
            p,
            retried: match outcome {
                Outcome::Commit => health::Retried::CommitDelivery,
                Outcome::Abort => health::Retried::AbortDelivery,
            },
            refusals: 0,
            mark: DeliveryMark::new(&driver.mailbox, (txid, p.id.clone())),
        }
    }

    /// Delivers until the participant acks or the delivery is no longer
    /// wanted here.
    async fn run(mut self) {
        while self.wanted() {
            let Some(step) = self.next_step().await else { return };
            match step {
                Step::Go { .. } => {
                    if self.attempt().await.is_break() {
                        return;
                    }
                }
                Step::Hold(wait) => tokio::time::sleep(wait).await,
                Step::Woken => {}
                Step::GaveUp => {
                    // The task stays, parked, so the leader loop does not
                    // start it over; it goes on if the address answers.
                    self.driver.log_given_up(self.txid, self.p, self.retried)
                }
            }
        }
    }

    /// Still this node's to deliver: it leads the delivery's term (the new
    /// leader delivers otherwise, invariant 9), and the applied record
    /// still waits for this participant's ack (not acked, e.g. with a
    /// READ_ONLY vote; not dropped; not forgotten).
    fn wanted(&self) -> bool {
        if !self.driver.ctx.is_leader_of(self.term) {
            return false;
        }
        let st = self.driver.ctx.sm.state();
        debug_assert!(
            st.table
                .get(self.txid)
                .and_then(|r| r.decision())
                .is_none_or(|d| d.outcome == self.outcome),
            "the recorded decision of {} changed under its delivery of {}",
            self.txid,
            self.outcome
        );
        st.table.awaiting_ack(self.txid, &self.p.id)
    }

    /// Its next step from the owner: at once, or once woken (`Woken` also
    /// after `PARKED_MAX`, to look at its leadership again). `None`: the
    /// owner is gone.
    async fn next_step(&self) -> Option<Step> {
        let (key, addr) = (self.mark.key().clone(), self.p.address.clone());
        let retried = self.retried;
        let turn = self.driver.mailbox.ask(|reply| Msg::NextTurn {
            key,
            addr,
            retried,
            reply,
        });
        match tokio::time::timeout(PARKED_MAX, turn).await {
            Ok(step) => step,
            Err(_) => Some(Step::Woken),
        }
    }

    /// One attempt: the decision as one item of its address's next
    /// ApplyDecisions message, what it showed reported to the owner, then
    /// the ack. `Break`: acked, the delivery is done.
    async fn attempt(&mut self) -> ControlFlow<()> {
        let d = self.driver;
        let sent = d
            .send_decision_grouped(self.txid, self.term, self.outcome, self.p)
            .await;
        let attempt = match sent {
            Ok(()) => Attempt::Applied,
            Err(DeliveryError::NoAnswer(e)) => {
                // Logged once per participant by its health record; the
                // next attempt waits for the probe turn or its backoff.
                self.count_failure("no_answer");
                Attempt::NoAnswer(e)
            }
            Err(DeliveryError::Refused { message, stale_term }) => {
                // The participant answered and refused this message: about
                // this transaction only (others go on).
                self.count_failure("refused");
                self.refusals = self.refusals.saturating_add(1);
                if !stale_term {
                    metrics::counter!("dtx_participant_protocol_errors_total").increment(1);
                    if self.refusals.is_power_of_two() {
                        warn!(txid = self.txid, participant = %Clean(&self.p.id), refusals = self.refusals,
                            "participant refused {}: {}", self.outcome, Clean(&message));
                    }
                }
                let wait = d.backoff(self.refusals);
                Attempt::Refused { message, wait }
            }
        };
        let u = rand::rng().random_range(0.0..=1.0);
        let key = self.mark.key().clone();
        d.mailbox.tell(Msg::Report {
            key,
            attempt: attempt.clone(),
            u,
        });
        match attempt {
            Attempt::Applied => self.ack().await,
            Attempt::NoAnswer(_) => ControlFlow::Continue(()),
            Attempt::Refused { wait, .. } => {
                tokio::time::sleep(wait).await;
                ControlFlow::Continue(())
            }
        }
    }

    fn count_failure(&self, kind: &'static str) {
        metrics::counter!(
            "dtx_delivery_failures_total",
            "kind" => kind,
            "participant" => crate::metrics::participant_label(&self.p.id)
        )
        .increment(1);
    }

    /// Records the ack through Raft (with the others of the ack queue); on
    /// a failure, tries the whole attempt again after a backoff.
    async fn ack(&self) -> ControlFlow<()> {
        let d = self.driver;
        match d.record_ack(self.txid, self.p.id.clone()).await {
            Ok(()) => {
                metrics::counter!("dtx_deliveries_total", "outcome" => self.outcome.to_string()).increment(1);
                dtx_failpoint::failpoint!("coordinator_mid_delivery");
                ControlFlow::Break(())
            }
            Err(e) => {
                warn!(txid = self.txid, participant = %Clean(&self.p.id), "ack not recorded yet: {e}");
                let wait = d.backoff(0);
                d.mailbox.tell(Msg::NoteAttempt {
                    key: self.mark.key().clone(),
                    error: Some((ErrorClass::Error, format!("ack not recorded: {e}"))),
                    next_in: Some(wait),
                });
                tokio::time::sleep(wait).await;
                ControlFlow::Continue(())
            }
        }
    }
}
