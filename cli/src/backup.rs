//! `coordinator admin backup` (its work: [`save`]) and `coordinator restore`:
//! the command-line side of backup and restore. The file format, the checks
//! and the writing of a data directory are the `coordinator::backup`
//! library's.

use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use coordinator::backup::BackupWriter;
use coordinator::backup::RestorePlan;
use coordinator::config::Config;
use coordinator::config::Member;
use dtx_proto::v1 as pb;
use dtx_proto::v1::admin_client::AdminClient;

/// How long `save` waits for the first answer and then for each chunk.
const CHUNK_WAIT: Duration = Duration::from_secs(60);

/// Options of `coordinator admin backup`.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct SaveOptions {
    /// Replace the file if it exists.
    #[arg(long)]
    pub force: bool,
    /// Back up the addressed node's own applied state without confirming
    /// it with a quorum: for a cluster that lost its majority for good. It
    /// may miss decisions applied elsewhere (the file says it is
    /// unconfirmed). Without it only the leader answers (a follower's
    /// refusal names the leader, which is then asked).
    #[arg(long)]
    pub unconfirmed: bool,
}

/// Takes a backup from the node at `addr` (following the leader's address
/// once when that node is not the leader) into `out`: written to a
/// temporary file beside it, checked (checksum and content) and renamed
/// only when complete. Refuses an existing `out` unless `opts.force`.
/// Returns a one-line summary.
pub async fn save(
    addr: &str,
    tls: Option<Arc<dtx_tls::ClientTls>>,
    token: Option<String>,
    out: &Path,
    opts: SaveOptions,
) -> anyhow::Result<String> {
    // Refused before the cluster is asked anything.
    let mut writer = BackupWriter::create(out, opts.force)?;
    let call = |addr: String| {
        let tls = tls.clone();
        let token = token.clone();
        async move {
            let ch = dtx_transport::channel::channel_with(&addr, None, Duration::from_secs(5), tls.as_ref())
                .map_err(anyhow::Error::msg)?;
            let rq = dtx_client::request_with_token(
                pb::BackupRequest {
                    unconfirmed: opts.unconfirmed,
                },
                token.as_deref(),
            );
            let answer = tokio::time::timeout(CHUNK_WAIT, AdminClient::new(ch).backup(rq))
                .await
                .map_err(|_| anyhow::anyhow!("no answer from {addr} within {CHUNK_WAIT:?}"))?;
            Ok::<_, anyhow::Error>(answer)
        }
    };
    let mut from = addr.to_string();
    let mut stream = match call(from.clone()).await? {
        Ok(r) => r.into_inner(),
        Err(s) => match dtx_proto::metadata::leader_hint(&s) {
            Some(leader) if !opts.unconfirmed && leader != from => {
                from = leader;
                call(from.clone())
                    .await?
                    .map_err(|s| status_error(&from, s))?
                    .into_inner()
            }
            _ => return Err(status_error(&from, s)),
        },
    };
    loop {
        let next = tokio::time::timeout(CHUNK_WAIT, stream.message())
            .await
            .map_err(|_| {
                anyhow::anyhow!("the backup stream from {from} stalled for {CHUNK_WAIT:?}; nothing was written")
            })?
            .map_err(|s| status_error(&from, s))?;
        match next {
            Some(chunk) => writer.write(&chunk.data)?,
            None => break,
        }
    }
    let backup = writer.finish()?;
    Ok(format!(
        "wrote {}: {}",
        out.display(),
        coordinator::backup::summary_line(&backup)
    ))
}

/// The status stays in the error's chain (callers map its code to an exit
/// code).
fn status_error(addr: &str, s: tonic::Status) -> anyhow::Error {
    let what = if s.code() == tonic::Code::Unimplemented {
        format!("{addr} does not take backups (a node of an older version?)")
    } else {
        format!("backup from {addr}")
    };
    anyhow::Error::new(s).context(what)
}

/// `coordinator restore`: writes the data directory of one node of a NEW
/// cluster from a backup (run it once per node of the new cluster, with the
/// same backup and members), then start each node with `coordinator serve`
/// (no --bootstrap).
#[derive(clap::Args, Debug)]
pub struct RestoreArgs {
    /// The backup file (from `coordinator admin backup --out FILE`).
    #[arg(long)]
    pub backup: PathBuf,
    /// Only read and check the backup (checksum, format, content) and print
    /// what it holds as JSON; write nothing.
    #[arg(long)]
    pub verify: bool,
    /// The new node's configuration file (what `serve --config` will get):
    /// its cluster_id, node_id, data_dir and bootstrap.members (the new
    /// cluster's members) are used. The flags below override them.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// The new cluster's id (must differ from the backed-up cluster's).
    #[arg(long)]
    pub cluster_id: Option<String>,
    /// This node's id in the new cluster.
    #[arg(long)]
    pub node_id: Option<u64>,
    /// This node's data directory: empty or absent.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// A member of the new cluster, as its peers and clients reach it:
    /// `ID,RAFT_ADDR,API_ADDR`. Repeat for each member (this node too);
    /// replaces the config's bootstrap.members.
    #[arg(long = "member", value_name = "ID,RAFT_ADDR,API_ADDR")]
    pub members: Vec<String>,
    /// Raise the next txid by N above the backup's. When the old cluster
    /// ran on after the backup was taken, it handed out txids the backup
    /// does not know and participants may hold: skip at least as many as it
    /// can have handed out since, so none is handed out again. Give every
    /// node the same N (the restore id differs otherwise). 0: exactly the
    /// backed-up state.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub skip_txids: u64,
}

fn parse_member(s: &str) -> anyhow::Result<Member> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    let [id, raft_addr, api_addr] = parts[..] else {
        anyhow::bail!("--member {s:?}: expected ID,RAFT_ADDR,API_ADDR");
    };
    Ok(Member {
        id: id
            .parse()
            .with_context(|| format!("--member {s:?}: {id:?} is not a node id"))?,
        raft_addr: raft_addr.to_string(),
        api_addr: api_addr.to_string(),
    })
}

fn plan(a: RestoreArgs) -> anyhow::Result<RestorePlan> {
    let config = match &a.config {
        Some(p) => Some(Config::from_file(p)?),
        None => None,
    };
    let from_config = |what: &str| anyhow::anyhow!("--{what} is required (or --config with it)");
    let cluster_id = match (a.cluster_id, &config) {
        (Some(c), _) => c,
        (None, Some(c)) => c.cluster_id.clone(),
        (None, None) => return Err(from_config("cluster-id")),
    };
    let node_id = match (a.node_id, &config) {
        (Some(n), _) => n,
        (None, Some(c)) => c.node_id,
        (None, None) => return Err(from_config("node-id")),
    };
    let data_dir = match (a.data_dir, &config) {
        (Some(d), _) => d,
        (None, Some(c)) => c.data_dir.clone(),
        (None, None) => return Err(from_config("data-dir")),
    };
    let members = if !a.members.is_empty() {
        a.members
            .iter()
            .map(|m| parse_member(m))
            .collect::<anyhow::Result<Vec<_>>>()?
    } else {
        match &config {
            Some(c) if !c.bootstrap.members.is_empty() => c.bootstrap.members.clone(),
            _ => anyhow::bail!("the new cluster's members are required: --member ID,RAFT_ADDR,API_ADDR for each, or --config with bootstrap.members"),
        }
    };
    Ok(RestorePlan {
        cluster_id,
        node_id,
        members,
        data_dir,
        skip_txids: a.skip_txids,
    })
}

pub async fn restore(a: RestoreArgs) -> anyhow::Result<()> {
    let path = a.backup.clone();
    let backup = coordinator::backup::read_backup(&path).with_context(|| format!("backup file {}", path.display()))?;
    if a.verify {
        println!(
            "{}",
            serde_json::to_string_pretty(&coordinator::backup::describe(&backup))?
        );
        eprintln!("{}: OK, {}", path.display(), coordinator::backup::summary_line(&backup));
        return Ok(());
    }
    let plan = plan(a)?;
    let s = coordinator::backup::restore_data_dir(&backup, &plan).await?;
    let h = &backup.header;
    if !h.confirmed {
        eprintln!(
            "warning: this backup was not confirmed by a quorum (node {}'s own applied state): it may miss decisions applied elsewhere",
            h.node_id
        );
    }
    println!(
        "restored node {} of cluster {} into {}: the state of cluster {} at log index {} (term {}), {} transactions, next txid {}",
        s.node_id,
        s.cluster_id,
        s.data_dir.display(),
        h.cluster_id,
        s.last_applied.index,
        s.last_applied.leader_id.term,
        s.transactions,
        s.next_txid,
    );
    if s.next_txid != h.next_txid {
        println!(
            "txids {} to {} are skipped (--skip-txids): never handed out by the new cluster",
            h.next_txid,
            s.next_txid - 1,
        );
    }
    println!(
        "restore id {} (every node of the new cluster must show the same one); start the node with `coordinator serve` (no --bootstrap): its first election is in a term above {}",
        s.restore_id, s.term
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_parse_or_say_why() {
        let m = parse_member("2,127.0.0.1:7102,127.0.0.1:7202").unwrap();
        assert_eq!(
            (m.id, m.raft_addr.as_str(), m.api_addr.as_str()),
            (2, "127.0.0.1:7102", "127.0.0.1:7202")
        );
        for bad in ["2,127.0.0.1:7102", "x,a,b", "1,a,b,c"] {
            let e = parse_member(bad).unwrap_err().to_string();
            assert!(e.contains("--member"), "{e}");
        }
    }
}
