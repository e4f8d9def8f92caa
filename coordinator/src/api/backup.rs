//! The `Backup` RPC (ADR 0017): the state machine's snapshot as of one
//! applied log index, in the self-describing file format of
//! `crate::backup`, streamed in chunks of `BACKUP_CHUNK_BYTES`.
//!
//! The file is built whole in memory before the first chunk leaves, from
//! one read of the state (the snapshot builder's own encoding, under the
//! state machine's lock), so the stream never mixes two points of the log.
//! By default only the leader answers, after a read-index round: the backup
//! then holds every decision applied anywhere before the call.

use std::sync::Arc;

use dtx_proto::v1 as pb;
use tonic::Response;
use tonic::Status;
use tracing::info;

use crate::backup::encode_backup;
use crate::backup::BackupHeader;
use crate::backup::BACKUP_CHUNK_BYTES;
use crate::ctx::now_ms;
use crate::ctx::ApiError;
use crate::ctx::NodeCtx;

/// The stream `Admin::backup` answers with.
pub type BackupStream = tonic::codegen::BoxStream<pb::BackupChunk>;

/// Builds the backup file's bytes on this node.
async fn build(ctx: &Arc<NodeCtx>, unconfirmed: bool) -> Result<(BackupHeader, Vec<u8>), ApiError> {
    if !unconfirmed {
        // Leader, confirmed by a quorum; what was applied before the call
        // is applied here now, and the snapshot below is taken later still.
        ctx.read_linearizable(|_| ()).await?;
    }
    let sm = ctx.sm.clone();
    let built = tokio::task::spawn_blocking(move || {
        let (meta, snapshot) = sm.snapshot_for_backup().map_err(|e| e.to_string())?;
        // Decoded back: the summary in the header comes from the very bytes
        // sent, and what does not decode is never sent.
        let table = crate::store::sm_store::decode_snapshot_table(&snapshot).map_err(|e| e.to_string())?;
        Ok::<_, String>((meta, snapshot, table.next_txid(), table.len() as u64))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("the backup task failed: {e}")))?
    .map_err(|e| ApiError::Internal(format!("cannot take the state machine's snapshot: {e}")))?;
    let (meta, snapshot, next_txid, transactions) = built;
    let Some(last_applied) = meta.last_log_id else {
        return Err(ApiError::Unavailable(
            "this node has applied nothing yet: there is no state to back up".into(),
        ));
    };
    // Read after the snapshot: at least every term the state mentions.
    let term = ctx.current_term().max(last_applied.leader_id.term);
    let header = BackupHeader {
        cluster_id: ctx.config.cluster_id.clone(),
        node_id: ctx.id,
        created_unix_ms: now_ms(),
        confirmed: !unconfirmed,
        term,
        last_applied,
        membership: meta.last_membership,
        next_txid,
        transactions,
        coordinator_version: env!("CARGO_PKG_VERSION").to_string(),
    };
    let bytes = encode_backup(&header, &snapshot).map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok((header, bytes))
}

/// `Admin::Backup`: answered by the addressed node (a follower refuses a
/// confirmed backup with the leader's address; it is not forwarded).
pub(crate) async fn backup(ctx: &Arc<NodeCtx>, req: pb::BackupRequest) -> Result<Response<BackupStream>, Status> {
    let started = std::time::Instant::now();
    let (header, bytes) = match build(ctx, req.unconfirmed).await {
        Ok(b) => b,
        Err(e) => {
            metrics::counter!("dtx_backups_total", "result" => "refused").increment(1);
            return Err(e.into());
        }
    };
    metrics::counter!("dtx_backups_total", "result" => "built").increment(1);
    info!(
        node_id = ctx.id,
        last_applied_index = header.last_applied.index,
        term = header.term,
        transactions = header.transactions,
        bytes = bytes.len(),
        confirmed = header.confirmed,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "backup built; streaming it"
    );
    Ok(Response::new(chunk_stream(bytes)))
}

/// `bytes` as a stream of chunks of at most `BACKUP_CHUNK_BYTES`, in order.
fn chunk_stream(bytes: Vec<u8>) -> BackupStream {
    let bytes = Arc::new(bytes);
    Box::pin(futures::stream::unfold(0usize, move |at| {
        let bytes = bytes.clone();
        async move {
            if at >= bytes.len() {
                return None;
            }
            let end = (at + BACKUP_CHUNK_BYTES).min(bytes.len());
            Some((
                Ok(pb::BackupChunk {
                    data: bytes[at..end].to_vec(),
                }),
                end,
            ))
        }
    }))
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;

    #[tokio::test]
    async fn chunks_are_bounded_and_in_order() {
        for len in [
            0,
            1,
            BACKUP_CHUNK_BYTES,
            BACKUP_CHUNK_BYTES + 1,
            3 * BACKUP_CHUNK_BYTES + 17,
        ] {
            let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let chunks: Vec<_> = chunk_stream(bytes.clone()).collect().await;
            assert_eq!(chunks.len(), len.div_ceil(BACKUP_CHUNK_BYTES), "{len}");
            let mut joined = Vec::new();
            for c in chunks {
                let c = c.unwrap();
                assert!(!c.data.is_empty() && c.data.len() <= BACKUP_CHUNK_BYTES);
                joined.extend_from_slice(&c.data);
            }
            assert_eq!(joined, bytes);
        }
    }
}
