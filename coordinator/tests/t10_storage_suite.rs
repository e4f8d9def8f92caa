//! openraft's own storage test suite against our log store (log files and
//! sled) and state-machine store (the storage half of the Raft contract in
//! docs/design.md#pinned-libraries).
#![allow(clippy::result_large_err)]

use coordinator::raft::StorageError;
use coordinator::raft::TypeConfig;
use coordinator::store::open_data_dir;
use coordinator::store::LogStore;
use coordinator::store::StateMachineStore;
use openraft::testing::StoreBuilder;
use openraft::testing::Suite;
use openraft::StorageIOError;
use tempfile::TempDir;

struct NodeStoreBuilder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, TempDir> for NodeStoreBuilder {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachineStore), StorageError> {
        let dir = TempDir::new().map_err(|e| StorageIOError::write(openraft::AnyError::new(&e)))?;
        let engine =
            open_data_dir(dir.path(), "suite", 1).map_err(|e| StorageIOError::write(openraft::AnyError::new(&e)))?;
        let sm =
            StateMachineStore::open(engine.clone()).map_err(|e| StorageIOError::read(openraft::AnyError::new(&e)))?;
        let log = LogStore::open(engine, dir.path()).map_err(|e| StorageIOError::write(openraft::AnyError::new(&e)))?;
        Ok((dir, log, sm))
    }
}

#[test]
fn openraft_storage_suite_passes_on_the_node_stores() -> Result<(), StorageError> {
    Suite::test_all(NodeStoreBuilder)
}

/// A node's stores as they open on `dir` (the order a node opens them).
fn open_stores(dir: &std::path::Path) -> (LogStore, StateMachineStore) {
    let engine = open_data_dir(dir, "suite", 1).unwrap();
    let log = LogStore::open(engine.clone(), dir).unwrap();
    let sm = StateMachineStore::open(engine).unwrap();
    (log, sm)
}

fn begin_entry(index: u64, key: &str) -> coordinator::raft::Entry {
    openraft::Entry {
        log_id: coordinator::raft::LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
        payload: openraft::EntryPayload::Normal(coordinator::raft::Batch {
            commands: vec![coordinator::sm::Command::Begin {
                idempotency_key: key.into(),
                fingerprint: [1; 32],
                now_ms: 1,
                timeout_ms: 60_000,
            }],
        }),
    }
}

/// A data directory with two entries in the log and applied, a snapshot,
/// and a vote, as this build writes it.
async fn written_data_dir() -> TempDir {
    use openraft::storage::RaftLogStorage;
    use openraft::storage::RaftStateMachine;
    use openraft::RaftSnapshotBuilder;
    let dir = TempDir::new().unwrap();
    // The node identity first, as a node's start writes it.
    drop(open_data_dir(dir.path(), "suite", 1).unwrap());
    let entries = vec![begin_entry(1, "a"), begin_entry(2, "b")];
    {
        // The log's files, written as `LogStore::append` writes them (its
        // flush callback cannot be made outside openraft).
        let wal = coordinator::store::log_store::open_wal(dir.path()).unwrap();
        let encoded: Vec<(u64, Vec<u8>)> = entries
            .iter()
            .map(|e| (e.log_id.index, coordinator::codec::encode(e).unwrap()))
            .collect();
        wal.append(&encoded).unwrap();
        wal.sync().unwrap();
    }
    let (mut log, mut sm) = open_stores(dir.path());
    sm.apply(entries).await.unwrap();
    sm.build_snapshot().await.unwrap();
    log.save_vote(&coordinator::raft::Vote::new(3, 2)).await.unwrap();
    dir
}

/// docs/adr/0042-storage-engines.md: everything a node stores, written by
/// this build, reads back after a restart: the node identity, the Raft
/// log's files and entries, the vote, the state machine and its snapshot.
#[tokio::test]
async fn a_data_directory_written_by_this_version_reads_back() {
    use openraft::storage::RaftLogStorage;
    use openraft::storage::RaftStateMachine;
    use openraft::RaftLogReader;
    let dir = written_data_dir().await;
    let (mut log, mut sm) = open_stores(dir.path());
    let entries = log.try_get_log_entries(0..u64::MAX).await.unwrap();
    assert_eq!(entries, vec![begin_entry(1, "a"), begin_entry(2, "b")]);
    assert_eq!(log.read_vote().await.unwrap(), Some(coordinator::raft::Vote::new(3, 2)));
    {
        let st = sm.state();
        assert_eq!(st.table.len(), 2);
        assert_eq!(st.last_applied.map(|l| l.index), Some(2));
    }
    let snap = sm.get_current_snapshot().await.unwrap().expect("the snapshot built");
    assert_eq!(snap.meta.last_log_id.map(|l| l.index), Some(2));
    let table = coordinator::store::sm_store::decode_snapshot_table(&snap.snapshot.into_inner()).unwrap();
    assert_eq!(table.len(), 2);
}

/// docs/adr/0042-storage-engines.md: a data directory a newer build wrote
/// is refused at start (and by `inspect`), naming what, the format version
/// found and the one this build reads, and left as it was: its identity
/// record (the first thing read), and a Raft log file.
#[tokio::test]
async fn a_newer_format_version_is_refused_by_name_at_start() {
    use coordinator::store::Space;
    let codec_version = coordinator::codec::FORMAT_VERSION;

    let dir = written_data_dir().await;
    {
        let engine = open_data_dir(dir.path(), "suite", 1).unwrap();
        let mut identity = engine.get(Space::NodeMeta, b"identity").unwrap().unwrap();
        assert_eq!(identity[0], codec_version);
        identity[0] = codec_version + 1;
        let mut b = coordinator::store::engine::WriteBatch::default();
        b.put(b"identity".to_vec(), identity);
        engine.write_batch(Space::NodeMeta, b).unwrap();
        engine.flush().unwrap();
    }
    let err = open_data_dir(dir.path(), "suite", 1).err().expect("refused");
    assert_eq!(
        err.to_string(),
        format!(
            "data directory {}: format version {} is newer than this build reads ({codec_version}): upgrade the binary; it was left as it was",
            dir.path().display(),
            codec_version + 1
        )
    );

    let dir = written_data_dir().await;
    let path = dir
        .path()
        .join(coordinator::store::log_store::WAL_DIR)
        .join(format!("{:020}.wal", 1));
    let mut file = std::fs::read(&path).unwrap();
    let wal_version = dtx_durable::wal::WAL_FORMAT_VERSION;
    file[..dtx_durable::wal::WAL_FILE_HEADER_BYTES].copy_from_slice(&dtx_durable::format::file_header(
        dtx_durable::wal::WAL_FILE_MAGIC,
        wal_version + 1,
    ));
    std::fs::write(&path, &file).unwrap();
    let refusal = format!(
        "data directory {}: raft log file {} format version {} is newer than this build reads ({wal_version}): upgrade the binary; it was left as it was",
        dir.path().display(),
        path.display(),
        wal_version + 1
    );
    let err = open_data_dir(dir.path(), "suite", 1).err().expect("refused");
    assert_eq!(err.to_string(), refusal);
    // `coordinator inspect` says the same.
    let err = coordinator::store::inspect(dir.path()).expect_err("refused");
    assert_eq!(err.to_string(), refusal);
    assert_eq!(std::fs::read(&path).unwrap(), file, "left as it was");
}
