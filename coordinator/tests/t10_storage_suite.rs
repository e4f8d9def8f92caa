//! openraft's own storage test suite against our log store (log files and
//! sled) and state-machine store (the storage half of DESIGN's Raft contract).
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
