//! The key layout of the sled step store's tree (see the module
//! documentation of `saga`): the business data (the outbox's keys among
//! them, `crate::outbox::store`), the inbox and the store's metadata,
//! each under its own first byte.

const DATA_PREFIX: u8 = b'd';
pub(super) const INBOX_PREFIX: u8 = b'n';
/// Repeated operation ids seen by Forward and Compensate (big-endian u64).
pub(super) const DUPLICATES_FORWARD_KEY: &[u8] = b"mduplicates-forward";
pub(super) const DUPLICATES_COMPENSATE_KEY: &[u8] = b"mduplicates-compensate";
/// The sled tree a store opened on a directory uses.
pub const STEP_TREE: &str = "saga_steps";

pub(super) fn data_key(key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.push(DATA_PREFIX);
    k.extend_from_slice(key);
    k
}

pub(super) fn inbox_key(operation_id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(operation_id.len() + 1);
    k.push(INBOX_PREFIX);
    k.extend_from_slice(operation_id.as_bytes());
    k
}

pub(super) fn read_u64(v: Option<sled::IVec>) -> u64 {
    v.and_then(|v| <[u8; 8]>::try_from(&v[..]).ok())
        .map(u64::from_be_bytes)
        .unwrap_or(0)
}
