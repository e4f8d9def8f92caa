//! The outbox and inbox in the SDK's own participant store
//! ([`ParticipantStore`]): keys in the resource's data space, under
//! prefixes a resource must not use (`\xffdtx.outbox/`, `\xffdtx.inbox/`),
//! written with the resource's own staged writes, so they become durable in
//! the same atomic batch and fsync as the business data, or not at all.
//!
//! Where a message is written decides when it is published:
//! - in `Resource::commit` (or in `ParticipantStore::write_data`, a local
//!   transaction): [`StoreOutbox::write`]; it is in the outbox once that
//!   write is;
//! - in `Resource::prepare`, with the YES vote: [`StoreOutbox::write_prepared`]
//!   keeps it with the transaction, out of the relays' sight;
//!   `Resource::commit` calls [`StoreOutbox::release_prepared`], which
//!   writes it into the outbox (its version assigned then, in commit
//!   order), and `Resource::abort` calls [`StoreOutbox::discard_prepared`].
//!   A NO vote discards every staged write, the message with them.
//!
//! Key layout (after the prefix `\xffdtx.outbox/`): `v` + aggregate -> the
//! aggregate's last version (8 bytes, big-endian); `m` + aggregate length
//! (2 bytes) + aggregate + version (8 bytes) -> an open message (pending
//! or dead-lettered; a published or discarded one is deleted), so a scan
//! finds each aggregate's lowest open version first; `p` + txid length
//! (1 byte) + txid key bytes + sequence (4 bytes) -> a prepared message.
//! The inbox (after `\xffdtx.inbox/` + name length (1 byte) + name): `i` +
//! message id -> when received; `t` + when (8 bytes) + message id -> empty,
//! for pruning by age.
//!
//! **Replicas.** The store is one process's (it locks its directory), so
//! the relays that share its outbox are tasks of that process (created
//! from one [`StoreOutbox`], which holds their leases). A claim is a lease
//! in memory: the aggregate, the relay that holds it and until when
//! ([`RelaySettings::lease_ms`]); other relays skip a leased aggregate
//! until the lease ends, so each aggregate is published by one relay at a
//! time, in version order. A service that runs several replicas (several
//! processes) gives each its own store and its own outbox: each relays
//! what it wrote. Leases are not written to disk: after a restart every
//! relay of the old process is gone, and its claims with it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::Mutex;

use dtx_tls::logtext::Clean;

use super::publish_within;
use super::report_duplicate;
use super::report_pass;
use super::Clock;
use super::DeadLetter;
use super::Envelope;
use super::OutboxMessage;
use super::Publisher;
use super::Received;
use super::RelayOnce;
use super::RelayPass;
use super::RelaySettings;
use super::SystemClock;
use crate::log::GlobalTxid;
use crate::store::ParticipantStore;
use crate::store::Resource;
use crate::store::Staged;
use crate::store::StoreError;
use crate::store::View;

/// Reads of a store's business data, as the outbox and the inbox make
/// them: the participant store's [`View`], the saga step store's
/// `StepView`.
pub trait DataRead {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;
    /// Every (key, value) whose key starts with `prefix`, in key order.
    fn scan(&self, prefix: &[u8]) -> Result<Vec<crate::store::KvPair>, StoreError>;
}

/// One call's staged writes of business data: the participant store's
/// [`Staged`], the saga step store's `StepStaged`.
pub trait DataWrite: Default + Send {
    fn put(&mut self, key: &[u8], value: &[u8]);
    fn delete(&mut self, key: &[u8]);
    /// What this call wrote last for `key`: `Some(Some(v))` set,
    /// `Some(None)` removed, `None` untouched.
    fn latest(&self, key: &[u8]) -> Option<Option<&[u8]>>;
    /// How many keys starting with `prefix` this call sets so far.
    fn count_set_with_prefix(&self, prefix: &[u8]) -> usize;
    /// Adds `other`'s writes after these.
    fn extend(&mut self, other: Self);
}

/// A store whose business data an outbox and an inbox live in (the
/// participant store, the saga step store): a view of it, and durable
/// writes of it outside any transaction.
pub trait DataStore: Send + Sync + 'static {
    type View<'a>: DataRead
    where
        Self: 'a;
    type Staged: DataWrite;
    fn data_view(&self) -> Self::View<'_>;
    /// Stages writes with `f` and makes them durable, atomically.
    fn write_data_with<'s>(
        &'s self,
        f: impl FnOnce(&Self::View<'_>, &mut Self::Staged) + Send + 's,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 's;
    /// Waits until every write made before is durable.
    fn flush_data(&self) -> impl Future<Output = Result<(), StoreError>> + Send + '_;
}

impl DataRead for View<'_> {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        View::get(self, key)
    }

    fn scan(&self, prefix: &[u8]) -> Result<Vec<crate::store::KvPair>, StoreError> {
        View::scan(self, prefix)
    }
}

impl DataWrite for Staged {
    fn put(&mut self, key: &[u8], value: &[u8]) {
        Staged::put(self, key, value)
    }

    fn delete(&mut self, key: &[u8]) {
        Staged::delete(self, key)
    }

    fn latest(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        Staged::latest(self, key)
    }

    fn count_set_with_prefix(&self, prefix: &[u8]) -> usize {
        Staged::count_set_with_prefix(self, prefix)
    }

    fn extend(&mut self, other: Self) {
        Staged::extend(self, other)
    }
}

impl<R: Resource> DataStore for ParticipantStore<R> {
    type View<'a> = View<'a>;
    type Staged = Staged;

    fn data_view(&self) -> View<'_> {
        self.view()
    }

    fn write_data_with<'s>(
        &'s self,
        f: impl FnOnce(&View<'_>, &mut Staged) + Send + 's,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 's {
        self.write_data(f)
    }

    fn flush_data(&self) -> impl Future<Output = Result<(), StoreError>> + Send + '_ {
        self.flush()
    }
}

/// A shared store is the store (so `&Arc<store>` passes where a store
/// does).
impl<T: DataStore> DataStore for Arc<T> {
    type View<'a> = T::View<'a>;
    type Staged = T::Staged;

    fn data_view(&self) -> T::View<'_> {
        T::data_view(self)
    }

    fn write_data_with<'s>(
        &'s self,
        f: impl FnOnce(&T::View<'_>, &mut T::Staged) + Send + 's,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 's {
        T::write_data_with(self, f)
    }

    fn flush_data(&self) -> impl Future<Output = Result<(), StoreError>> + Send + '_ {
        T::flush_data(self)
    }
}

/// The outbox's keys start with this (in the resource's data space).
pub const OUTBOX_KEY_PREFIX: &[u8] = b"\xffdtx.outbox/";
/// The inboxes' keys start with this.
pub const INBOX_KEY_PREFIX: &[u8] = b"\xffdtx.inbox/";
/// The format version of an encoded message record.
const RECORD_FORMAT: u8 = 1;
const PENDING: u8 = 0;
const DEAD: u8 = 2;

fn key(kind: u8, rest: &[&[u8]]) -> Vec<u8> {
    let mut k = OUTBOX_KEY_PREFIX.to_vec();
    k.push(kind);
    for r in rest {
        k.extend_from_slice(r);
    }
    k
}

fn version_key(aggregate: &str) -> Vec<u8> {
    key(b'v', &[aggregate.as_bytes()])
}

fn message_key(aggregate: &str, version: u64) -> Result<Vec<u8>, StoreError> {
    let len = u16::try_from(aggregate.len())
        .map_err(|_| StoreError::Io(format!("outbox aggregate of {} bytes (at most 65535)", aggregate.len())))?;
    Ok(key(
        b'm',
        &[&len.to_be_bytes(), aggregate.as_bytes(), &version.to_be_bytes()],
    ))
}

/// (aggregate, version) of a message key.
fn parse_message_key(k: &[u8]) -> Option<(String, u64)> {
    let rest = k.strip_prefix(OUTBOX_KEY_PREFIX)?.strip_prefix(b"m")?;
    let len = u16::from_be_bytes(rest.get(..2)?.try_into().ok()?) as usize;
    let agg = rest.get(2..2 + len)?;
    let v = rest.get(2 + len..)?;
    Some((
        String::from_utf8(agg.to_vec()).ok()?,
        u64::from_be_bytes(v.try_into().ok()?),
    ))
}

fn prepared_prefix(txid: GlobalTxid) -> Vec<u8> {
    let t = txid.key_bytes();
    key(b'p', &[&[t.len() as u8], &t])
}

/// An open message as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Record {
    state: u8,
    attempts: u32,
    next_attempt_ms: u64,
    created_ms: u64,
    topic: String,
    payload: Vec<u8>,
    last_error: String,
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(b);
}

/// Reads what `put_bytes` wrote at the front of `b`.
fn take_bytes<'a>(b: &mut &'a [u8]) -> Option<&'a [u8]> {
    let len = u32::from_be_bytes(b.get(..4)?.try_into().ok()?) as usize;
    let out = b.get(4..4 + len)?;
    *b = &b[4 + len..];
    Some(out)
}

fn take_u64(b: &mut &[u8]) -> Option<u64> {
    let v = u64::from_be_bytes(b.get(..8)?.try_into().ok()?);
    *b = &b[8..];
    Some(v)
}

impl Record {
    fn encode(&self) -> Vec<u8> {
        let mut out = vec![RECORD_FORMAT, self.state];
        out.extend_from_slice(&self.attempts.to_be_bytes());
        out.extend_from_slice(&self.next_attempt_ms.to_be_bytes());
        out.extend_from_slice(&self.created_ms.to_be_bytes());
        put_bytes(&mut out, self.topic.as_bytes());
        put_bytes(&mut out, &self.payload);
        put_bytes(&mut out, self.last_error.as_bytes());
        out
    }

    fn decode(b: &[u8]) -> Result<Record, StoreError> {
        let bad = || StoreError::Io("an outbox record does not decode".into());
        if b.first() != Some(&RECORD_FORMAT) {
            return Err(StoreError::Io(format!(
                "outbox record format version {:?}; this build reads {RECORD_FORMAT}",
                b.first()
            )));
        }
        let state = *b.get(1).ok_or_else(bad)?;
        let attempts = u32::from_be_bytes(b.get(2..6).ok_or_else(bad)?.try_into().map_err(|_| bad())?);
        let mut rest = &b[6..];
        let next_attempt_ms = take_u64(&mut rest).ok_or_else(bad)?;
        let created_ms = take_u64(&mut rest).ok_or_else(bad)?;
        let text = |b: &[u8]| String::from_utf8(b.to_vec()).map_err(|_| bad());
        let topic = text(take_bytes(&mut rest).ok_or_else(bad)?)?;
        let payload = take_bytes(&mut rest).ok_or_else(bad)?.to_vec();
        let last_error = text(take_bytes(&mut rest).ok_or_else(bad)?)?;
        Ok(Record {
            state,
            attempts,
            next_attempt_ms,
            created_ms,
            topic,
            payload,
            last_error,
        })
    }
}

fn encode_message(msg: &OutboxMessage) -> Vec<u8> {
    let mut out = vec![RECORD_FORMAT];
    put_bytes(&mut out, msg.aggregate.as_bytes());
    put_bytes(&mut out, msg.topic.as_bytes());
    put_bytes(&mut out, &msg.payload);
    out
}

fn decode_message(b: &[u8]) -> Result<OutboxMessage, StoreError> {
    let bad = || StoreError::Io("a prepared outbox message does not decode".into());
    let mut rest = b.strip_prefix(&[RECORD_FORMAT]).ok_or_else(bad)?;
    let text = |b: &[u8]| String::from_utf8(b.to_vec()).map_err(|_| bad());
    let aggregate = text(take_bytes(&mut rest).ok_or_else(bad)?)?;
    let topic = text(take_bytes(&mut rest).ok_or_else(bad)?)?;
    let payload = take_bytes(&mut rest).ok_or_else(bad)?.to_vec();
    Ok(OutboxMessage {
        aggregate,
        topic,
        payload,
    })
}

/// Reads `key` as this call's staged writes and then the view show it.
fn read<V: DataRead, S: DataWrite>(view: &V, staged: &S, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
    match staged.latest(key) {
        Some(v) => Ok(v.map(<[u8]>::to_vec)),
        None => view.get(key),
    }
}

/// A claim: which relay holds an aggregate, and until when.
struct Lease {
    owner: String,
    until_ms: u64,
}

struct Inner {
    clock: Arc<dyn Clock>,
    /// By aggregate.
    leases: Mutex<HashMap<String, Lease>>,
}

/// The outbox in a participant store. Clone it into the resource (to
/// write) and into the relays (to publish): the clones share the relays'
/// leases.
#[derive(Clone)]
pub struct StoreOutbox {
    inner: Arc<Inner>,
}

impl Default for StoreOutbox {
    fn default() -> Self {
        Self::new()
    }
}

impl StoreOutbox {
    /// On the system clock.
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock))
    }

    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        StoreOutbox {
            inner: Arc::new(Inner {
                clock,
                leases: Mutex::new(HashMap::new()),
            }),
        }
    }

    fn now(&self) -> u64 {
        self.inner.clock.now_ms()
    }

    /// Stages `msg` into the outbox with the caller's other writes (in
    /// `Resource::commit`, or `ParticipantStore::write_data`); returns the
    /// version it got. Several messages of one call get consecutive
    /// versions.
    pub fn write<V: DataRead, S: DataWrite>(
        &self,
        view: &V,
        staged: &mut S,
        msg: &OutboxMessage,
    ) -> Result<u64, StoreError> {
        let vk = version_key(&msg.aggregate);
        let last = match read(view, staged, &vk)? {
            Some(b) => u64::from_be_bytes(
                b.as_slice()
                    .try_into()
                    .map_err(|_| StoreError::Io("an outbox version does not decode".into()))?,
            ),
            None => 0,
        };
        let version = last + 1;
        let now = self.now();
        let record = Record {
            state: PENDING,
            attempts: 0,
            next_attempt_ms: now,
            created_ms: now,
            topic: msg.topic.clone(),
            payload: msg.payload.clone(),
            last_error: String::new(),
        };
        staged.put(&message_key(&msg.aggregate, version)?, &record.encode());
        staged.put(&vk, &version.to_be_bytes());
        Ok(version)
    }

    /// Stages `msg` with `txid`'s YES vote (in `Resource::prepare`): kept
    /// with the transaction and not published until
    /// [`release_prepared`](Self::release_prepared) runs in its commit.
    pub fn write_prepared<V: DataRead, S: DataWrite>(
        &self,
        view: &V,
        staged: &mut S,
        txid: GlobalTxid,
        msg: &OutboxMessage,
    ) -> Result<(), StoreError> {
        let prefix = prepared_prefix(txid);
        let seq = view.scan(&prefix)?.len() + staged.count_set_with_prefix(&prefix);
        let mut k = prefix;
        k.extend_from_slice(&(seq as u32).to_be_bytes());
        staged.put(&k, &encode_message(msg));
        Ok(())
    }

    /// In `Resource::commit`: writes `txid`'s prepared messages into the
    /// outbox, in the order they were prepared; returns how many.
    pub fn release_prepared<V: DataRead, S: DataWrite>(
        &self,
        view: &V,
        staged: &mut S,
        txid: GlobalTxid,
    ) -> Result<usize, StoreError> {
        let held = view.scan(&prepared_prefix(txid))?;
        for (k, v) in &held {
            self.write(view, staged, &decode_message(v)?)?;
            staged.delete(k);
        }
        Ok(held.len())
    }

    /// In `Resource::abort`: drops `txid`'s prepared messages; returns how
    /// many.
    pub fn discard_prepared<V: DataRead, S: DataWrite>(
        &self,
        view: &V,
        staged: &mut S,
        txid: GlobalTxid,
    ) -> Result<usize, StoreError> {
        let held = view.scan(&prepared_prefix(txid))?;
        for (k, _) in &held {
            staged.delete(k);
        }
        Ok(held.len())
    }

    /// Every open message (pending or dead-lettered), by aggregate and
    /// version.
    fn open<V: DataRead>(&self, view: &V) -> Result<Vec<(String, u64, Record)>, StoreError> {
        let mut out = Vec::new();
        for (k, v) in view.scan(&key(b'm', &[]))? {
            let (agg, version) =
                parse_message_key(&k).ok_or_else(|| StoreError::Io("an outbox key does not decode".into()))?;
            out.push((agg, version, Record::decode(&v)?));
        }
        Ok(out)
    }

    /// How long the oldest message not published yet (pending or
    /// dead-lettered) has waited; `None` when there is none.
    pub fn oldest_unpublished_age_ms<V: DataRead>(&self, view: &V) -> Result<Option<u64>, StoreError> {
        let now = self.now();
        Ok(self
            .open(view)?
            .iter()
            .map(|(_, _, r)| r.created_ms)
            .min()
            .map(|c| now.saturating_sub(c)))
    }

    /// Messages pending (not dead-lettered).
    pub fn pending_count<V: DataRead>(&self, view: &V) -> Result<usize, StoreError> {
        Ok(self.open(view)?.iter().filter(|(_, _, r)| r.state == PENDING).count())
    }

    /// The dead-lettered messages, by aggregate and version.
    pub fn dead_letters<V: DataRead>(&self, view: &V) -> Result<Vec<DeadLetter>, StoreError> {
        Ok(self
            .open(view)?
            .into_iter()
            .filter(|(_, _, r)| r.state == DEAD)
            .map(|(aggregate, version, r)| DeadLetter {
                aggregate,
                version,
                topic: r.topic,
                payload: r.payload,
                attempts: r.attempts,
                last_error: r.last_error,
                created_ms: r.created_ms,
            })
            .collect())
    }

    /// Changes a dead-lettered message with `f` (staged in `staged`);
    /// false when it is not dead-lettered.
    fn change_dead<V: DataRead, S: DataWrite>(
        view: &V,
        staged: &mut S,
        aggregate: &str,
        version: u64,
        f: impl FnOnce(Record) -> Option<Record>,
    ) -> Result<bool, StoreError> {
        let k = message_key(aggregate, version)?;
        let Some(b) = view.get(&k)? else {
            return Ok(false);
        };
        let r = Record::decode(&b)?;
        if r.state != DEAD {
            return Ok(false);
        }
        match f(r) {
            Some(r) => staged.put(&k, &r.encode()),
            None => staged.delete(&k),
        }
        Ok(true)
    }

    /// Puts a dead-lettered message back to pending, due now, its attempts
    /// reset. False when it is not dead-lettered.
    pub async fn requeue<H: DataStore>(&self, store: &H, aggregate: &str, version: u64) -> Result<bool, StoreError> {
        let now = self.now();
        let mut out = Ok(false);
        store
            .write_data_with(|view, staged| {
                out = Self::change_dead(view, staged, aggregate, version, |r| {
                    Some(Record {
                        state: PENDING,
                        attempts: 0,
                        next_attempt_ms: now,
                        ..r
                    })
                });
            })
            .await?;
        out
    }

    /// Gives up a dead-lettered message for good (deleted): the
    /// aggregate's later messages go on. False when it is not
    /// dead-lettered.
    pub async fn discard<H: DataStore>(&self, store: &H, aggregate: &str, version: u64) -> Result<bool, StoreError> {
        let mut out = Ok(false);
        store
            .write_data_with(|view, staged| {
                out = Self::change_dead(view, staged, aggregate, version, |_| None);
            })
            .await?;
        out
    }

    /// A relay named `owner` over `store`'s outbox.
    pub fn relay<H: DataStore, P: Publisher>(
        &self,
        store: Arc<H>,
        owner: impl Into<String>,
        publisher: Arc<P>,
        settings: RelaySettings,
    ) -> StoreRelay<H, P> {
        StoreRelay {
            outbox: self.clone(),
            store,
            owner: owner.into(),
            publisher,
            settings,
        }
    }
}

/// A relay over a [`StoreOutbox`] in one process (see the module's
/// "Replicas").
pub struct StoreRelay<H: DataStore, P: Publisher> {
    outbox: StoreOutbox,
    store: Arc<H>,
    owner: String,
    publisher: Arc<P>,
    settings: RelaySettings,
}

/// A claimed message: its aggregate's lowest open version.
struct Claim {
    msg: Envelope,
    record: Record,
}

impl<H: DataStore, P: Publisher> StoreRelay<H, P> {
    /// Takes leases on up to `batch_max` aggregates whose lowest open
    /// message is pending and due and that no other relay holds.
    fn claim(&self, now: u64) -> Result<Vec<Claim>, StoreError> {
        let mut leases = self.outbox.inner.leases.lock().expect("outbox leases");
        let mut out = Vec::new();
        let mut last: Option<String> = None;
        for (agg, version, r) in self.outbox.open(&self.store.data_view())? {
            if last.as_deref() == Some(agg.as_str()) {
                continue; // not the aggregate's lowest open version
            }
            last = Some(agg.clone());
            if r.state != PENDING || r.next_attempt_ms > now {
                continue;
            }
            if leases
                .get(&agg)
                .is_some_and(|l| l.owner != self.owner && l.until_ms > now)
            {
                continue;
            }
            leases.insert(
                agg.clone(),
                Lease {
                    owner: self.owner.clone(),
                    until_ms: now.saturating_add(self.settings.lease_ms),
                },
            );
            out.push(Claim {
                msg: Envelope {
                    aggregate: agg,
                    version,
                    topic: r.topic.clone(),
                    payload: r.payload.clone(),
                    attempts: r.attempts,
                    created_ms: r.created_ms,
                },
                record: r,
            });
            if out.len() >= self.settings.batch_max {
                break;
            }
        }
        Ok(out)
    }

    fn release(&self, claims: &[Claim]) {
        let mut leases = self.outbox.inner.leases.lock().expect("outbox leases");
        for c in claims {
            if leases.get(&c.msg.aggregate).is_some_and(|l| l.owner == self.owner) {
                leases.remove(&c.msg.aggregate);
            }
        }
    }

    /// One pass: claims (leases), makes the claimed messages durable (only
    /// durable messages leave), publishes each, records the outcomes in
    /// one write, releases the leases, sets the metrics.
    pub async fn run_once(&mut self) -> Result<RelayPass, StoreError> {
        let now = self.outbox.now();
        let claims = self.claim(now)?;
        let res = self.publish_and_record(now, &claims).await;
        self.release(&claims);
        let pass = res?;
        let age = self.outbox.oldest_unpublished_age_ms(&self.store.data_view())?;
        report_pass(&self.settings.name, &pass, age);
        Ok(pass)
    }

    async fn publish_and_record(&self, now: u64, claims: &[Claim]) -> Result<RelayPass, StoreError> {
        let mut pass = RelayPass {
            claimed: claims.len(),
            ..RelayPass::default()
        };
        if claims.is_empty() {
            return Ok(pass);
        }
        self.store.flush_data().await?;
        let mut outcomes = Vec::with_capacity(claims.len());
        for c in claims {
            outcomes.push(publish_within(self.publisher.as_ref(), &c.msg, &self.settings).await);
        }
        let mut err = None;
        self.store
            .write_data_with(|view, staged| {
                for (c, outcome) in claims.iter().zip(&outcomes) {
                    let k = match message_key(&c.msg.aggregate, c.msg.version) {
                        Ok(k) => k,
                        Err(e) => {
                            err = Some(e);
                            return;
                        }
                    };
                    // Gone or changed: another relay took it after our
                    // lease ended and recorded it first.
                    if view.get(&k).ok().flatten().as_deref() != Some(&c.record.encode()[..]) {
                        continue;
                    }
                    match outcome {
                        Ok(()) => {
                            staged.delete(&k);
                            pass.published += 1;
                        }
                        Err(reason) => {
                            let attempts = c.record.attempts + 1;
                            let state = if attempts >= self.settings.max_attempts {
                                pass.dead_lettered += 1;
                                tracing::warn!(outbox = %self.settings.name, aggregate = %Clean(&c.msg.aggregate),
                                    version = c.msg.version, "outbox message dead-lettered after {attempts} attempts: {reason}");
                                DEAD
                            } else {
                                pass.failed += 1;
                                PENDING
                            };
                            let r = Record {
                                state,
                                attempts,
                                next_attempt_ms: now.saturating_add(self.settings.backoff_ms(attempts)),
                                last_error: reason.clone(),
                                ..c.record.clone()
                            };
                            staged.put(&k, &r.encode());
                        }
                    }
                }
            })
            .await?;
        match err {
            Some(e) => Err(e),
            None => Ok(pass),
        }
    }
}

impl<H: DataStore, P: Publisher> RelayOnce for StoreRelay<H, P> {
    async fn run_once(&mut self) -> Result<RelayPass, String> {
        StoreRelay::run_once(self).await.map_err(|e| e.to_string())
    }

    fn settings(&self) -> &RelaySettings {
        &self.settings
    }
}

/// An inbox in a participant store.
#[derive(Clone)]
pub struct StoreInbox {
    name: String,
    clock: Arc<dyn Clock>,
}

impl StoreInbox {
    /// The inbox `name` (its keys and its metrics' `inbox` label); names
    /// are at most 255 bytes.
    pub fn new(name: &str, clock: Arc<dyn Clock>) -> Result<Self, String> {
        if name.is_empty() || name.len() > 255 {
            return Err(format!("inbox name {name:?}: 1 to 255 bytes"));
        }
        Ok(StoreInbox {
            name: name.to_string(),
            clock,
        })
    }

    fn prefix(&self, kind: u8) -> Vec<u8> {
        let mut k = INBOX_KEY_PREFIX.to_vec();
        k.push(self.name.len() as u8);
        k.extend_from_slice(self.name.as_bytes());
        k.push(kind);
        k
    }

    /// Records `message_id` with the caller's staged writes: false when it
    /// is new (recorded now: the caller goes on, its effects durable with
    /// the id), true when it was recorded before (a duplicate: skip it).
    pub fn seen<V: DataRead, S: DataWrite>(
        &self,
        view: &V,
        staged: &mut S,
        message_id: &str,
    ) -> Result<bool, StoreError> {
        let mut ik = self.prefix(b'i');
        ik.extend_from_slice(message_id.as_bytes());
        if read(view, staged, &ik)?.is_some() {
            report_duplicate(&self.name);
            return Ok(true);
        }
        let now = self.clock.now_ms();
        staged.put(&ik, &now.to_be_bytes());
        let mut tk = self.prefix(b't');
        tk.extend_from_slice(&now.to_be_bytes());
        tk.extend_from_slice(message_id.as_bytes());
        staged.put(&tk, &[]);
        Ok(false)
    }

    /// Handles `message_id` once: records it and runs `handler`, whose
    /// writes become durable with the id in one write (the store's calls
    /// run one at a time, so concurrent deliveries of one id run the
    /// handler once). A duplicate does not run it. A handler error writes
    /// nothing.
    pub async fn receive<R: Resource, T>(
        &self,
        store: &ParticipantStore<R>,
        message_id: &str,
        handler: impl FnOnce(&View<'_>, &mut Staged) -> Result<T, String>,
    ) -> Result<Result<Received<T>, String>, StoreError> {
        let mut out: Result<Result<Received<T>, String>, StoreError> = Ok(Ok(Received::Duplicate));
        store
            .write_data(|view, staged| {
                let mut mine = Staged::default();
                out = match self.seen(view, &mut mine, message_id) {
                    Err(e) => Err(e),
                    Ok(true) => Ok(Ok(Received::Duplicate)),
                    Ok(false) => match handler(view, &mut mine) {
                        Ok(v) => {
                            staged.extend(mine);
                            Ok(Ok(Received::Handled(v)))
                        }
                        Err(e) => Ok(Err(e)),
                    },
                };
            })
            .await?;
        out
    }

    /// Deletes the ids received more than `retention_ms` ago; returns how
    /// many. A message redelivered after that is handled again, so the
    /// retention must exceed the longest redelivery delay.
    pub async fn prune<H: DataStore>(&self, store: &H, retention_ms: u64) -> Result<usize, StoreError> {
        let before = self.clock.now_ms().saturating_sub(retention_ms);
        let tp = self.prefix(b't');
        let mut n = 0;
        store
            .write_data_with(|view, staged| {
                let Ok(all) = view.scan(&tp) else { return };
                for (k, _) in all {
                    let Some(rest) = k.strip_prefix(&tp[..]) else { continue };
                    let Some(ms) = rest.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_be_bytes) else {
                        continue;
                    };
                    if ms >= before {
                        break; // in time order
                    }
                    let mut ik = self.prefix(b'i');
                    ik.extend_from_slice(&rest[8..]);
                    staged.delete(&ik);
                    staged.delete(&k);
                    n += 1;
                }
            })
            .await?;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_keys_read_back() {
        let r = Record {
            state: DEAD,
            attempts: 3,
            next_attempt_ms: 9,
            created_ms: 7,
            topic: "orders".into(),
            payload: vec![0, 1, 255],
            last_error: "broker down".into(),
        };
        assert_eq!(Record::decode(&r.encode()).unwrap(), r);
        let k = message_key("order-1", 42).unwrap();
        assert_eq!(parse_message_key(&k), Some(("order-1".to_string(), 42)));
        let m = OutboxMessage::new("a", "t", b"p".to_vec());
        assert_eq!(decode_message(&encode_message(&m)).unwrap(), m);
        // An aggregate's versions sort by number.
        assert!(message_key("a", 9).unwrap() < message_key("a", 10).unwrap());
    }
}
