//! Documented request limits. They are constants, not configuration, because
//! the replicated state machine checks them too and must decide identically on
//! every node. Each name carries its unit.

/// Idempotency keys, participant ids and operator names: 1..=this many bytes.
pub const ID_BYTES_MAX: usize = 128;
/// Participant service addresses.
pub const ADDRESS_BYTES_MAX: usize = 256;
/// Opaque payload handed to a participant with Prepare.
pub const PAYLOAD_BYTES_MAX: usize = 64 * 1024;
/// Opaque description bytes of a Begin request.
pub const DESCRIPTION_BYTES_MAX: usize = 4096;
/// Free-text reasons and notes.
pub const REASON_BYTES_MAX: usize = 1024;
/// Notes recorded with a decision (an operator's name and reason fit).
pub const NOTE_BYTES_MAX: usize = ID_BYTES_MAX + REASON_BYTES_MAX + 64;
/// Participants in one transaction.
pub const PARTICIPANTS_MAX: usize = 32;
/// Transaction ids in one batched decision read.
pub const DECISION_BATCH_TXIDS_MAX: usize = 1024;
/// Items (one transaction's decision for one participant each) in one
/// `ParticipantService.ApplyDecisions` message.
pub const DECISION_DELIVERY_ITEMS_MAX: usize = 256;
/// Items (one transaction's Prepare for one participant each) in one
/// `ParticipantService.PrepareMany` message.
pub const PREPARE_GROUP_ITEMS_MAX: usize = 256;
/// Payload bytes (the sum over its items) the leader puts in one
/// `PrepareMany` message at most (a single item may be up to
/// `PAYLOAD_BYTES_MAX`), well below the 4 MiB a gRPC server decodes by
/// default.
pub const PREPARE_GROUP_PAYLOAD_BYTES_MAX: usize = 1024 * 1024;
/// Most txids one `ReserveTxids` hands a leader (the fast commit path's
/// range, ADR 0012).
pub const TXID_RESERVE_COUNT_MAX: u64 = 1 << 20;
/// Records in one `Admin.ListTransactions` page when the request asks for
/// 0.
pub const LIST_TRANSACTIONS_PAGE_RECORDS_DEFAULT: usize = 100;
/// Most records one `Admin.ListTransactions` page may ask for.
pub const LIST_TRANSACTIONS_PAGE_RECORDS_MAX: usize = 1000;
/// Most bytes of transactions one `Admin.ListTransactions` answer carries
/// (the page is cut short beyond, keeping at least one), well under the
/// 4 MiB a gRPC client decodes by default.
pub const LIST_TRANSACTIONS_PAGE_BYTES_MAX: usize = 2 * 1024 * 1024;
/// Most records one `Admin.ListTransactions` call looks at (holding the
/// leader's state for reading) before it answers with the page so far and
/// where to go on: a filter that few records meet still answers quickly.
pub const LIST_TRANSACTIONS_SCAN_RECORDS_MAX: usize = 100_000;
/// Most records one `ParticipantService.Inspect` call names or lists in
/// each of its lists: txids looked up, recent records asked for (more:
/// INVALID_ARGUMENT), and in-doubt records listed (the rest are counted).
pub const INSPECT_RECORDS_MAX: usize = 1000;
/// Largest encoded value the codec accepts from disk or network (network
/// messages are further bounded by `raft.max_message_bytes`).
pub const DECODE_BYTES_MAX: usize = 256 * 1024 * 1024;
/// Steps in one saga definition.
pub const SAGA_STEPS_MAX: usize = 32;
/// A step's output (what its forward action answered with its OK, handed
/// to every later step's calls and journaled): so one call carries at most
/// `SAGA_STEPS_MAX` times this many bytes of earlier outputs (512 KiB),
/// well under the 4 MiB a gRPC server decodes by default.
pub const SAGA_STEP_OUTPUT_BYTES_MAX: usize = 16 * 1024;
/// Sagas in one page of `ListSagas` when the request names no limit.
pub const LIST_SAGAS_PAGE_DEFAULT: usize = 100;
/// Sagas in one page of `ListSagas` at most.
pub const LIST_SAGAS_PAGE_MAX: usize = 1000;
