//! One coordinator node: opens storage, starts Raft, serves the Raft
//! transport and the API, and runs the leader-only loops (deadline reaper and
//! forget). `run` takes its configuration and a shutdown future, so tests and
//! `coordinator dev` start nodes the same way `coordinator serve` does.
//!
//! Whether the node serves (`raft::serving`) shows on both gRPC ports
//! (`grpc.health.v1`), in `ClusterStatus`, on the metrics port's `/health`
//! and in the gauges; the API port also answers server reflection.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use dtx_proto::v1::admin_server::AdminServer;
use dtx_proto::v1::coordinator_server::CoordinatorServer;
use dtx_proto::v1::raft_transport_server::RaftTransportServer;
use dtx_proto::v1::saga_service_server::SagaServiceServer;
use http_body_util::Full;
use hyper::body::Bytes;
use metrics_exporter_prometheus::PrometheusHandle;
use openraft::error::RaftError;
use openraft::SnapshotPolicy;
use tracing::error;
use tracing::info;
use tracing::warn;

use crate::batcher::BatchSettings;
use crate::batcher::Batcher;
use crate::config::Config;
use crate::ctx::now_ms;
use crate::ctx::NodeCtx;
use crate::driver::Driver;
use crate::raft::network::ChannelCache;
use crate::raft::network::Network;
use crate::raft::network::NetworkSettings;
use crate::raft::service::RaftService;
use crate::raft::serving;
use crate::raft::serving::HealthTarget;
use crate::raft::serving::Monitor;
use crate::raft::serving::PeerContacts;
use crate::raft::NodeId;
use crate::raft::NodeInfo;
use crate::raft::Raft;
use crate::store;
use crate::store::LogStore;
use crate::store::StateMachineStore;

fn raft_config(c: &Config) -> anyhow::Result<openraft::Config> {
    let rc = openraft::Config {
        cluster_name: c.cluster_id.clone(),
        heartbeat_interval: c.raft.heartbeat_interval_ms,
        election_timeout_min: c.raft.election_timeout_min_ms,
        election_timeout_max: c.raft.election_timeout_max_ms,
        max_payload_entries: c.raft.append_entries_max,
        snapshot_policy: SnapshotPolicy::LogsSinceLast(c.raft.snapshot_logs_since_last),
        max_in_snapshot_log_to_keep: c.raft.logs_to_keep_after_snapshot,
        snapshot_max_chunk_size: c.raft.snapshot_chunk_bytes,
        install_snapshot_timeout: 5_000,
        ..Default::default()
    };
    rc.validate().context("invalid raft settings")
}

/// Whether the filesystem holding `dir` is mounted read-only (the kernel
/// remounts ext4 and others read-only after a write error: EROFS).
pub fn read_only_filesystem(dir: &std::path::Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statvfs(3) writes only into `st`, which lives on this stack
    // frame; `path` is a valid NUL-terminated string.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        libc::statvfs(path.as_ptr(), &mut st) == 0 && (st.f_flag & libc::ST_RDONLY) != 0
    }
}

/// What a node on a read-only filesystem says (it once said "damaged", and
/// it was not).
fn read_only_text(data_dir: &std::path::Path) -> String {
    format!(
        "data directory {} is on a read-only filesystem (EROFS: the kernel remounts a filesystem read-only after a \
         write error, or it was mounted so); it is not damaged by that, and this node changed nothing in it. Check \
         the disk and the kernel log (dmesg), run a filesystem check, mount it read-write again, then start the node: \
         what it acknowledged is on disk, and it catches up from the leader",
        data_dir.display()
    )
}

/// Why a store in the data directory could not be opened: a full disk or
/// a read-only filesystem says so; anything else is damage, which the node
/// never repairs.
fn store_open_error(
    data_dir: &std::path::Path,
    what: &str,
    no_space: bool,
    e: &dyn std::fmt::Display,
) -> anyhow::Error {
    if read_only_filesystem(data_dir) {
        anyhow::anyhow!("cannot load {what}: {}: {e}", read_only_text(data_dir))
    } else if no_space {
        anyhow::anyhow!("cannot load {what} from data directory {}: {e}", data_dir.display())
    } else {
        anyhow::anyhow!(
            "data directory {} is damaged: {what} cannot be read: {e}; the node does not start on it and never resets or repairs it: copy it aside and keep it for inspection",
            data_dir.display()
        )
    }
}

/// Runs a node until `shutdown` resolves or Raft stops on a fatal error.
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    config.validate()?;
    let raft_listen: SocketAddr = config.raft_addr.parse()?;
    let api_listen: SocketAddr = config.api_addr.parse()?;
    // Certificates first: a node with bad TLS files stops before it
    // touches its data directory.
    let security = crate::security::Security::load(&config)?;
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("cannot create data_dir {}", config.data_dir.display()))?;
    if read_only_filesystem(&config.data_dir) {
        anyhow::bail!(read_only_text(&config.data_dir));
    }
    let engine = store::open_data_dir(&config.data_dir, &config.cluster_id, config.node_id)?;
    let mut log_store = LogStore::open(engine.clone(), &config.data_dir)
        .map_err(|e| store_open_error(&config.data_dir, "the Raft log", e.is_no_space(), &e))?;
    // Before openraft takes the log: a node that led a term before it
    // stopped runs for a new one rather than resuming it (ADR 0028).
    log_store
        .open_for_node(config.node_id)
        .await
        .context("cannot store the vote back as uncommitted")?;
    let log_durability = log_store.durability();
    let sm = StateMachineStore::open(engine.clone())
        .map_err(|e| store_open_error(&config.data_dir, "the state machine", e.is_no_space(), &e))?
        .applying_only_durable(log_durability.clone());
    let local_ip = Some(raft_listen.ip()).filter(|ip| !ip.is_unspecified());
    let network = Network::new(NetworkSettings {
        cluster_id: config.cluster_id.clone(),
        self_id: config.node_id,
        local_ip,
        max_message_bytes: config.raft.max_message_bytes,
        connect_timeout: Duration::from_millis(config.raft.connect_timeout_ms),
        tls: security.client_tls.clone(),
        log_durability,
        log_sync_stall_max: Duration::from_millis(config.raft.election_timeout_min_ms),
        commit_index_defer_max: config.raft.commit_index_defer_window(),
    });
    let raft = Raft::new(
        config.node_id,
        Arc::new(raft_config(&config)?),
        network,
        log_store,
        sm.clone(),
    )
    .await
    .context("cannot start raft")?;
    // From here a fatal error of Raft ends `coordinator serve`'s process
    // within a bound, however the way out goes (`fatal_exit`).
    crate::fatal_exit::watch(config.node_id, raft.metrics(), FATAL_EXIT_MAX);
    let contacts = PeerContacts::default();
    let _quorum_probe =
        crate::raft::quorum_probe::spawn(raft.clone(), &config, security.client_tls.clone(), contacts.clone());

    let batcher = Batcher::start(
        raft.clone(),
        BatchSettings {
            entries_max: config.batch.entries_max,
            bytes_max: config.batch.bytes_max,
            wait_us: config.batch.wait_us,
            inflight_max: config.batch.inflight_max,
            refill_wait_us: config.batch.refill_wait_us,
            refill_callers_min: config.batch.refill_callers_min,
            queue_max: config.batch.queue_max,
        },
    );
    let ctx = Arc::new(NodeCtx {
        id: config.node_id,
        config: config.clone(),
        raft: raft.clone(),
        sm,
        batcher,
        engine: engine.clone(),
        channels: ChannelCache::new(local_ip, Duration::from_millis(config.raft.connect_timeout_ms))
            .with_tls(security.client_tls.clone()),
        participant_gate: crate::ctx::ParticipantGate::new(
            security.participant_token.clone(),
            raft.clone(),
            config.node_id,
            &config,
        ),
    });
    let driver = Driver::new(ctx.clone());
    let policy = crate::saga_policy::RuleSet::new(config.saga.policy_rules.clone());
    let (orchestrator, saga_scan) = crate::orchestrator::Orchestrator::new(ctx.clone(), Arc::new(policy));

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);

    // Health: NOT_SERVING until the serving monitor finds otherwise (the
    // reporter starts with "" SERVING), on each port for its own services.
    let (api_health, api_health_service) = tonic_health::server::health_reporter();
    let (raft_health, raft_health_service) = tonic_health::server::health_reporter();
    let health = vec![
        HealthTarget {
            reporter: api_health,
            services: vec![
                "",
                dtx_proto::v1::coordinator_server::SERVICE_NAME,
                dtx_proto::v1::admin_server::SERVICE_NAME,
                dtx_proto::v1::saga_service_server::SERVICE_NAME,
            ],
        },
        HealthTarget {
            reporter: raft_health,
            services: vec!["", dtx_proto::v1::raft_transport_server::SERVICE_NAME],
        },
    ];
    for h in &health {
        h.set(false).await;
    }
    let (monitor, monitor_task) = serving::spawn(
        raft.clone(),
        serving::Limits::of(&config),
        Duration::from_millis(config.raft.heartbeat_interval_ms),
        contacts,
        config.raft.quorum_probe_interval_ms > 0,
        health,
        stop_rx.clone(),
    );
    // Ended with the node however `run` returns (the early returns below
    // included); on a stop it has set NOT_SERVING before (it watches
    // `stop_rx`).
    let _monitor_task = AbortOnDrop(monitor_task);

    let _metrics_server = match &config.metrics_addr {
        Some(addr) => {
            let addr: SocketAddr = addr.parse()?;
            match tokio::net::TcpListener::bind(addr).await {
                Ok(l) => Some(AbortOnDrop(tokio::spawn(serve_metrics(
                    l,
                    prometheus(),
                    monitor.clone(),
                    driver.clone(),
                )))),
                Err(e) => {
                    warn!("metrics listener not started on {addr}: {e}");
                    None
                }
            }
        }
        None => None,
    };
    let reloaders = security.spawn_reloaders(Duration::from_millis(config.tls.reload_interval_ms));
    let raft_router = tonic::transport::Server::builder()
        .layer(security.raft_layer(Some(crate::security::member_check(raft.clone(), true))))
        .layer(monitor.layer())
        .add_service(raft_health_service.clone())
        .add_service(
            RaftTransportServer::new(RaftService {
                raft: raft.clone(),
                cluster_id: config.cluster_id.clone(),
            })
            .max_decoding_message_size(config.raft.max_message_bytes)
            .max_encoding_message_size(config.raft.max_message_bytes),
        );
    let raft_server = serve(
        raft_router,
        raft_listen,
        "raft_addr",
        security.raft_tls.clone(),
        stop_rx.clone(),
    )
    .await?;
    let api_router = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(config.api.max_concurrent_streams_per_connection))
        .layer(security.api_layer(&config.api, Some(crate::security::member_check(raft.clone(), false))))
        .layer(monitor.layer())
        .add_service(api_health_service)
        .add_service(reflection_v1()?)
        .add_service(reflection_v1alpha()?)
        .add_service(
            CoordinatorServer::new(crate::api::coordinator::CoordinatorService::new(driver.clone()))
                .max_decoding_message_size(config.api.max_message_bytes),
        )
        .add_service(
            AdminServer::new(crate::api::admin::AdminService::new(driver.clone()))
                .max_decoding_message_size(config.api.max_message_bytes),
        )
        .add_service(
            SagaServiceServer::new(crate::api::saga::SagaApi::new(ctx.clone(), orchestrator.clone()))
                .max_decoding_message_size(config.api.max_message_bytes),
        );
    let api_server = serve(
        api_router,
        api_listen,
        "api_addr",
        security.api_tls.clone(),
        stop_rx.clone(),
    )
    .await?;
    info!(
        node_id = config.node_id,
        cluster_id = %config.cluster_id,
        raft_addr = %raft_listen,
        api_addr = %api_listen,
        tls = security.api_tls.is_some(),
        auth = security.auth,
        data_dir = %config.data_dir.display(),
        "node started"
    );

    if config.bootstrap.enabled {
        bootstrap(&raft, &config).await?;
    }
    let loops = tokio::spawn(leader_loops(driver.clone(), stop_rx.clone()));
    let _sagas = AbortOnDrop(tokio::spawn(saga_scan.run(stop_rx.clone())));
    let gauges = tokio::spawn(report_gauges(driver.clone(), monitor.clone()));

    // Stop on the caller's signal, or when Raft stops on a fatal error (for
    // example a storage failure): the node never keeps serving without Raft.
    let mut metrics = raft.metrics();
    let fatal = async move {
        loop {
            if let Err(e) = &metrics.borrow().running_state {
                return e.to_string();
            }
            if metrics.changed().await.is_err() {
                return "raft stopped".to_string();
            }
        }
    };
    let outcome = tokio::select! {
        _ = shutdown => Ok(()),
        reason = fatal => Err(anyhow::anyhow!("raft stopped on a fatal error: {reason}")),
    };
    // The alert line goes out first: nothing below (for example a final
    // flush that fails on the same full disk) may keep it from the log.
    // It also arms the bounded exit of `coordinator serve` (`fatal_exit`):
    // a drop or join below that waits for a hung flush cannot keep the
    // process from ending with this error.
    if let Err(e) = &outcome {
        crate::fatal_exit::fatal(config.node_id, &format!("{e:#}"), FATAL_EXIT_MAX);
    }
    info!(node_id = config.node_id, "node stopping");
    let _ = stop_tx.send(true);
    loops.abort();
    gauges.abort();
    for r in reloaders {
        r.abort();
    }
    // Every step of the way out is bounded: a node whose Raft stopped must
    // exit (so a supervisor restarts it), not wait for clients to close
    // their connections (found by the jepsen disk-full nemesis: a leader
    // stopped on a full disk stayed up 90 s serving nothing).
    let grace = if outcome.is_ok() {
        SHUTDOWN_GRACE_MAX
    } else {
        FATAL_SHUTDOWN_GRACE_MAX
    };
    // Each step says when it is done, so a slow one shows in the log.
    if tokio::time::timeout(grace, raft.shutdown()).await.is_err() {
        warn!(
            node_id = config.node_id,
            "raft did not shut down within {grace:?}; going on"
        );
    } else {
        info!(node_id = config.node_id, "node stopping: raft shut down");
    }
    let servers = [raft_server.abort_handle(), api_server.abort_handle()];
    let closed = tokio::time::timeout(grace, async {
        let _ = raft_server.await;
        let _ = api_server.await;
    })
    .await;
    if closed.is_err() {
        warn!(
            node_id = config.node_id,
            "connections still open after {grace:?}; closing them"
        );
        for s in servers {
            s.abort();
        }
    } else {
        info!(node_id = config.node_id, "node stopping: servers closed");
    }
    // Everything acknowledged is on disk already (each append is synced
    // before it counts); this flush only covers writes nobody waits for.
    // It runs on a blocking thread, bounded too: after a failed write the
    // store may never finish it.
    let flushing = tokio::task::spawn_blocking({
        let engine = engine.clone();
        move || engine.flush()
    });
    let flushed = match tokio::time::timeout(grace, flushing).await {
        Ok(Ok(r)) => r.map_err(anyhow::Error::new),
        Ok(Err(e)) => Err(anyhow::anyhow!("the flush task failed: {e}")),
        Err(_) => Err(anyhow::anyhow!("not finished within {grace:?}")),
    };
    if let Err(e) = flushed {
        // After a fatal storage error this usually fails the same way; the
        // node exits with the fatal error, and this is logged beside it.
        error!(node_id = config.node_id, "final flush failed: {e:#}");
        if outcome.is_ok() {
            return Err(e.context("final flush failed"));
        }
    }
    outcome
}

/// A task ended when this is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How long a stopping node waits for Raft to shut down and, then, for
/// in-flight calls to finish, on a requested stop.
const SHUTDOWN_GRACE_MAX: Duration = Duration::from_secs(5);
/// The same after Raft stopped on a fatal error: nothing can be served.
const FATAL_SHUTDOWN_GRACE_MAX: Duration = Duration::from_secs(1);
/// After Raft stopped on a fatal error, the longest `coordinator serve`'s
/// process takes to exit (`fatal_exit`): room for the three bounded steps
/// (Raft, the servers, the final flush) and the command's runtime shutdown
/// (2 s), after which it ends whatever is still waiting.
const FATAL_EXIT_MAX: Duration = Duration::from_secs(6);

/// The layers in front of both gRPC ports' services: the edge (who may
/// call what), then the serving monitor's handle for the handlers.
type Layers = tower_layer::Stack<serving::MonitorLayer, tower_layer::Stack<dtx_tls::EdgeLayer, tower_layer::Identity>>;

/// Binds `addr` and serves `router` on it (with TLS when `tls` is set)
/// until `stop` turns true.
async fn serve(
    router: tonic::transport::server::Router<Layers>,
    addr: SocketAddr,
    what: &str,
    tls: Option<Arc<dtx_tls::ServerTls>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {what} {addr}"))?;
    let incoming = dtx_tls::incoming(listener, tls);
    Ok(tokio::spawn(router.serve_with_incoming_shutdown(
        incoming,
        async move {
            let _ = stop.wait_for(|s| *s).await;
        },
    )))
}

async fn bootstrap(raft: &Raft, config: &Config) -> anyhow::Result<()> {
    if raft.is_initialized().await? {
        info!("data directory already holds cluster state; bootstrap skipped");
        return Ok(());
    }
    let members: BTreeMap<NodeId, NodeInfo> = crate::raft::nodes_of(&config.bootstrap.members);
    match raft.initialize(members).await {
        Ok(()) => info!("initialized a new cluster"),
        Err(RaftError::APIError(e)) => info!("initialize skipped: {e}"),
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// Exports this node's Raft position, whether it serves, and its table
/// size as gauges, every second. `dtx_raft_is_leader` is 1 only for a
/// leader that serves (one a majority acknowledges): a leader cut off from
/// its majority keeps openraft's Leader state until it hears of a newer
/// term, and must not be counted as the cluster's leader meanwhile.
async fn report_gauges(driver: Arc<Driver>, monitor: Monitor) {
    let ctx = &driver.ctx;
    loop {
        {
            let serving = monitor.status().verdict.serving;
            let rx = ctx.raft.metrics();
            let m = rx.borrow();
            metrics::gauge!("dtx_serving").set(if serving { 1.0 } else { 0.0 });
            metrics::gauge!("dtx_raft_term").set(m.current_term as f64);
            let leads = m.current_leader == Some(ctx.id) && serving;
            metrics::gauge!("dtx_raft_is_leader").set(if leads { 1.0 } else { 0.0 });
            metrics::gauge!("dtx_raft_last_log_index").set(m.last_log_index.unwrap_or(0) as f64);
            metrics::gauge!("dtx_raft_last_applied_index").set(m.last_applied.map(|l| l.index).unwrap_or(0) as f64);
            metrics::gauge!("dtx_raft_snapshot_index").set(m.snapshot.map(|l| l.index).unwrap_or(0) as f64);
        }
        {
            let st = ctx.sm.state();
            metrics::gauge!("dtx_transactions").set(st.transactions() as f64);
            metrics::gauge!("dtx_transactions_retained").set(st.retained_count as f64);
            // PREPARING and undelivered counts, and the oldest in-doubt ages.
            crate::metrics::report_table(&st.table, now_ms());
        }
        metrics::gauge!("dtx_participants_failing").set(driver.failing_participants().await as f64);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The leader-only loop's clock: every `txn.reaper_interval_ms` the driver
/// does one round of background work (`Driver::background_round`: phase two
/// and re-drives to resume, the deadline reaper, forgetting) if this node
/// leads; a change of term wakes parked deliveries first.
async fn leader_loops(driver: Arc<Driver>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let ctx = &driver.ctx;
    let interval = Duration::from_millis(ctx.config.txn.reaper_interval_ms);
    let mut last_term = 0;
    let mut withholding = false;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let term = ctx.current_term();
        if term != last_term {
            // Parked deliveries look at their leadership again: those of
            // an older term end, so a re-elected node starts them afresh.
            last_term = term;
            driver.wake_all();
        }
        if !ctx.is_leader() || !ctx.caught_up_in_term() {
            continue;
        }
        // Invariant 13: a leader cut off from its quorum drives nothing
        // (openraft 0.9 keeps it leader in its old term for as long as it
        // is cut off); it goes on once a quorum answers it again, or ends
        // its work when another leader's term reaches it.
        if let Err(why) = ctx.quorum_heard() {
            if !withholding {
                warn!(term, "background work withheld: {why}");
                withholding = true;
            }
            continue;
        }
        if withholding {
            info!(term, "a quorum answers this leader again: background work resumes");
            withholding = false;
        }
        if ctx.sm.state().incarnations.current().is_none() {
            // A new cluster, one from before incarnations or one just
            // restored: choose the incarnation before anything is handed
            // out (ADR 0033). Calls that hand out ids do it too.
            if let Err(e) = ctx.open_incarnation().await {
                warn!(term, "could not open a cluster incarnation yet: {e}");
            }
        }
        driver.background_round(term, now_ms()).await;
    }
}

/// Server reflection (v1) for the API port: the services it serves, with
/// their descriptors, so `grpcurl` needs no `.proto` files.
fn reflection_v1() -> anyhow::Result<
    tonic_reflection::server::v1::ServerReflectionServer<impl tonic_reflection::server::v1::ServerReflection>,
> {
    reflection("grpc.reflection.v1.ServerReflection")
        .build_v1()
        .context("server reflection (v1)")
}

/// The same for clients that speak only the older v1alpha.
fn reflection_v1alpha() -> anyhow::Result<
    tonic_reflection::server::v1alpha::ServerReflectionServer<impl tonic_reflection::server::v1alpha::ServerReflection>,
> {
    reflection("grpc.reflection.v1alpha.ServerReflection")
        .build_v1alpha()
        .context("server reflection (v1alpha)")
}

fn reflection(itself: &str) -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(dtx_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        // Only what this port serves: the dtx.v1 files also describe the
        // Raft transport and the participants' service.
        .with_service_name(dtx_proto::v1::coordinator_server::SERVICE_NAME)
        .with_service_name(dtx_proto::v1::admin_server::SERVICE_NAME)
        .with_service_name("grpc.health.v1.Health")
        .with_service_name(itself)
}

/// The process's Prometheus recorder, with `crate::metrics`'s settings and
/// HELP texts (installed once; every node of the process renders the same
/// one), or None when another recorder was installed first.
fn prometheus() -> Option<PrometheusHandle> {
    static HANDLE: std::sync::OnceLock<Option<PrometheusHandle>> = std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| match crate::metrics::exporter().install_recorder() {
            Ok(h) => {
                crate::metrics::describe();
                Some(h)
            }
            Err(e) => {
                warn!("metrics recorder not installed: {e}; the metrics port serves only /health");
                None
            }
        })
        .clone()
}

/// How often the recorder's upkeep runs (draining histograms), as the
/// exporter's own listener did.
const METRICS_UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// The metrics port (HTTP/1): `/health` answers 200 `SERVING` or 503
/// `NOT_SERVING: <reason>` from the serving monitor; `/console` and below
/// is the read-only web console (`crate::console`; 404 when
/// `console_enabled` is false); `/metrics` answers the Prometheus text;
/// every other path 404 (metrics-exporter-prometheus's listener answered
/// the text on every path). Every answer carries
/// `X-Content-Type-Options: nosniff`.
async fn serve_metrics(
    listener: tokio::net::TcpListener,
    handle: Option<PrometheusHandle>,
    monitor: Monitor,
    driver: Arc<Driver>,
) {
    let mut upkeep = tokio::time::interval(METRICS_UPKEEP_INTERVAL);
    loop {
        let stream = tokio::select! {
            _ = upkeep.tick() => {
                if let Some(h) = &handle {
                    h.run_upkeep();
                }
                continue;
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    warn!("metrics port: accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let handle = handle.clone();
        let monitor = monitor.clone();
        let driver = driver.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let handle = handle.clone();
                let monitor = monitor.clone();
                let driver = driver.clone();
                let (method, uri) = (req.method().clone(), req.uri().clone());
                async move { Ok::<_, Infallible>(metrics_response(&method, &uri, handle, &monitor, &driver).await) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await
            {
                tracing::debug!("metrics port: connection ended: {e}");
            }
        });
    }
}

async fn metrics_response(
    method: &hyper::Method,
    uri: &hyper::Uri,
    handle: Option<PrometheusHandle>,
    monitor: &Monitor,
    driver: &Arc<Driver>,
) -> hyper::Response<Full<Bytes>> {
    let path = uri.path();
    let path_and_query = uri.path_and_query().map(|p| p.as_str()).unwrap_or(path);
    if let Some((status, content_type, body)) =
        crate::console::handle(method.as_str(), path_and_query, driver, monitor).await
    {
        let mut resp = hyper::Response::new(Full::new(Bytes::from(body)));
        *resp.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
        let headers = resp.headers_mut();
        headers.insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static(content_type),
        );
        for (name, value) in crate::console::HEADERS {
            headers.insert(name, hyper::header::HeaderValue::from_static(value));
        }
        if status == 405 {
            headers.insert(hyper::header::ALLOW, hyper::header::HeaderValue::from_static("GET"));
        }
        return resp;
    }
    let (status, body) = if path == "/health" {
        let v = monitor.status().verdict;
        if v.serving {
            (hyper::StatusCode::OK, "SERVING\n".to_string())
        } else {
            (
                hyper::StatusCode::SERVICE_UNAVAILABLE,
                format!("NOT_SERVING: {}\n", v.reason),
            )
        }
    } else if path == "/metrics" {
        let text = match handle {
            Some(h) => tokio::task::spawn_blocking(move || h.render())
                .await
                .unwrap_or_default(),
            None => String::new(),
        };
        (hyper::StatusCode::OK, text)
    } else {
        (
            hyper::StatusCode::NOT_FOUND,
            "not found: this port serves /metrics, /health and /console\n".to_string(),
        )
    };
    let mut resp = hyper::Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain"),
    );
    resp.headers_mut().insert(
        hyper::header::X_CONTENT_TYPE_OPTIONS,
        hyper::header::HeaderValue::from_static("nosniff"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node whose filesystem was remounted read-only said its data
    /// directory was "damaged".
    #[test]
    fn a_read_only_filesystem_is_named_as_such_never_damage() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!read_only_filesystem(dir.path()), "a temporary directory is writable");
        let e = store_open_error(dir.path(), "the Raft log", false, &"os error 30");
        assert!(
            e.to_string().contains("is damaged"),
            "a writable one keeps the damage text: {e}"
        );
        let text = read_only_text(dir.path());
        assert!(text.contains("EROFS") && !text.contains("is damaged"), "{text}");
    }
}
