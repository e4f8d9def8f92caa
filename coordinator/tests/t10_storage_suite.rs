//! openraft's own storage test suite against our sled-backed log store and
//! state-machine store (the storage half of DESIGN's Raft contract).
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

struct SledBuilder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, TempDir> for SledBuilder {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachineStore), StorageError> {
        let dir = TempDir::new().map_err(|e| StorageIOError::write(openraft::AnyError::new(&e)))?;
        let engine =
            open_data_dir(dir.path(), "suite", 1).map_err(|e| StorageIOError::write(openraft::AnyError::new(&e)))?;
        let sm =
            StateMachineStore::open(engine.clone()).map_err(|e| StorageIOError::read(openraft::AnyError::new(&e)))?;
        Ok((dir, LogStore::new(engine), sm))
    }
}

#[test]
fn openraft_storage_suite_passes_on_sled_store() -> Result<(), StorageError> {
    Suite::test_all(SledBuilder)
}
