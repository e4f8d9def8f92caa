//! A stand-in for a system outside a step service (a payment provider),
//! for the saga step tests (ADR 0034): each idempotency key is acted on at
//! most once and answered the same every time; a status query tells what
//! a key did and, asked with a fence, makes "not done" final (the key is
//! voided and refused from then on). Switches lose its replies after it
//! acted, lose requests before they arrive, and make its status query
//! unable to tell.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use participant_sdk::saga::OutsideStatus;
use participant_sdk::saga::OutsideSystem;

/// Answers (the outside system's encoding, as text).
pub const VOIDED: &str = "voided";

#[derive(Default)]
struct State {
    /// key -> (request, answer)
    keys: BTreeMap<String, (Vec<u8>, String)>,
    balances: BTreeMap<String, i64>,
}

#[derive(Default)]
pub struct Provider {
    state: Mutex<State>,
    /// The provider acts, then its reply is lost.
    pub lose_replies: AtomicBool,
    /// Requests are lost before they arrive (nothing happens).
    pub drop_requests: AtomicBool,
    /// The status query cannot tell (the provider is unreachable for it).
    pub status_down: AtomicBool,
    /// Requests that arrived.
    pub arrived: AtomicUsize,
}

impl Provider {
    /// Accounts `who` with `balance` each.
    pub fn with_accounts(accounts: &[(&str, i64)]) -> Provider {
        let p = Provider::default();
        p.state.lock().unwrap().balances = accounts.iter().map(|(w, b)| (w.to_string(), *b)).collect();
        p
    }

    pub fn balance(&self, who: &str) -> i64 {
        self.state.lock().unwrap().balances[who]
    }

    /// Charges held (keys answered `charged`, not refunded).
    pub fn charges(&self) -> usize {
        let st = self.state.lock().unwrap();
        st.keys.values().filter(|(_, a)| a.starts_with("charged")).count()
    }

    /// What the provider holds under `key`.
    pub fn answer(&self, key: &str) -> Option<String> {
        self.state.lock().unwrap().keys.get(key).map(|(_, a)| a.clone())
    }

    /// A request arriving at the provider (a late one, say): acts once per
    /// key, answers the key's answer.
    ///
    /// Requests: `charge:<who>:<amount>` → `charged:<who>:<amount>` or
    /// `declined: insufficient funds`; `refund:<charge key>` →
    /// `refunded:<charge key>` or `nothing to refund`. A key voided by a
    /// fence answers `voided`.
    pub fn arrive(&self, key: &str, request: &[u8]) -> Result<String, String> {
        self.arrived.fetch_add(1, Ordering::SeqCst);
        let mut st = self.state.lock().unwrap();
        if let Some((req, answer)) = st.keys.get(key) {
            if answer != VOIDED && req != request {
                return Err(format!("key {key} was used for another request"));
            }
            return Ok(answer.clone());
        }
        let text = String::from_utf8_lossy(request).into_owned();
        let answer = if let Some(rest) = text.strip_prefix("charge:") {
            let (who, amount) = rest.split_once(':').ok_or("bad charge")?;
            let amount: i64 = amount.parse().map_err(|_| "bad amount")?;
            let bal = st.balances.get_mut(who).ok_or("no such account")?;
            if *bal < amount {
                "declined: insufficient funds".to_string()
            } else {
                *bal -= amount;
                format!("charged:{who}:{amount}")
            }
        } else if let Some(charge_key) = text.strip_prefix("refund:") {
            match st.keys.get(charge_key).map(|(_, a)| a.clone()) {
                Some(a) if a.starts_with("charged:") => {
                    let mut parts = a.split(':').skip(1);
                    let who = parts.next().unwrap().to_string();
                    let amount: i64 = parts.next().unwrap().parse().unwrap();
                    *st.balances.get_mut(&who).unwrap() += amount;
                    st.keys.get_mut(charge_key).unwrap().1 = format!("refunded-by:{key}");
                    format!("refunded:{charge_key}")
                }
                _ => "nothing to refund".to_string(),
            }
        } else {
            return Err(format!("unknown request {text:?}"));
        };
        st.keys.insert(key.to_string(), (request.to_vec(), answer.clone()));
        Ok(answer)
    }
}

#[tonic::async_trait]
impl OutsideSystem for Provider {
    fn name(&self) -> &str {
        "test payment provider"
    }

    async fn call(&self, key: &str, request: &[u8]) -> Result<Vec<u8>, String> {
        if self.drop_requests.load(Ordering::SeqCst) {
            return Err("timed out (the request never arrived)".into());
        }
        let answer = self.arrive(key, request)?;
        if self.lose_replies.load(Ordering::SeqCst) {
            return Err("timed out (the reply was lost)".into());
        }
        Ok(answer.into_bytes())
    }

    async fn status(&self, key: &str, _request: &[u8], fence: bool) -> OutsideStatus {
        if self.status_down.load(Ordering::SeqCst) {
            return OutsideStatus::Unknown("connection refused".into());
        }
        let mut st = self.state.lock().unwrap();
        match st.keys.get(key) {
            Some((_, answer)) => OutsideStatus::Done(answer.clone().into_bytes()),
            None if fence => {
                st.keys.insert(key.to_string(), (Vec::new(), VOIDED.into()));
                OutsideStatus::NotDone
            }
            None => OutsideStatus::NotDone,
        }
    }
}
