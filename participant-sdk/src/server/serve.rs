//! Running a participant service: [`serve`] and its TLS and guarded
//! variants put the gRPC service and its recovery loop on a listener, and
//! [`participant_policy`] says who may call which method.

use std::sync::Arc;
use std::time::Duration;

use super::cluster::RecoveryOptions;
use super::recovery::spawn_recovery_with;
use super::service::ParticipantServer;
use crate::participant::Participant;

/// Serves participant `participant_id` (as enlisted) on `listener`
/// (`dtx.v1.ParticipantService`, TCP_NODELAY and keep-alive on every
/// connection) with its recovery loop (`spawn_recovery_with`, asking
/// `cluster`), until `shutdown` completes; then stops recovery. A service
/// whose participant can stop by itself (the sled store on a failed write)
/// makes that part of `shutdown`. Plain text; [`serve_with_tls`] for TLS.
pub async fn serve<P: Participant>(
    participant: Arc<P>,
    participant_id: &str,
    listener: tokio::net::TcpListener,
    cluster: Vec<String>,
    recovery: RecoveryOptions,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    serve_with_tls(participant, participant_id, listener, cluster, recovery, None, shutdown).await
}

/// As [`serve`], over TLS when `tls` is set. Then every caller must
/// present a certificate from the authority (mutual TLS), and only the
/// cluster's nodes (`dtx://node/<id>`) may send Prepare, Commit, Abort and
/// the grouped calls; `Inquire` and `Inspect` also take operators. Anyone else is
/// refused (`UNAUTHENTICATED` or `PERMISSION_DENIED`, logged and counted
/// in `dtx_auth_refusals_total{server="participant"}`) before the
/// participant sees the message.
pub async fn serve_with_tls<P: Participant>(
    participant: Arc<P>,
    participant_id: &str,
    listener: tokio::net::TcpListener,
    cluster: Vec<String>,
    recovery: RecoveryOptions,
    tls: Option<Arc<dtx_tls::ServerTls>>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let guard = Guard {
        tls,
        node_tokens: dtx_tls::Tokens::default(),
    };
    serve_guarded(
        participant,
        participant_id,
        listener,
        cluster,
        recovery,
        guard,
        shutdown,
    )
    .await
}

/// Who may call a participant service: with `tls`, callers with a node's
/// certificate; with `node_tokens` (where mutual TLS is not used), callers
/// presenting one of those tokens (`authorization: Bearer`, the nodes'
/// `auth.participant_token_file`). With neither, anyone (plain text, no
/// check).
#[derive(Clone, Debug, Default)]
pub struct Guard {
    pub tls: Option<Arc<dtx_tls::ServerTls>>,
    /// Tokens with the node role.
    pub node_tokens: dtx_tls::Tokens,
}

/// As [`serve_with_tls`], with a [`Guard`]: TLS, node tokens, or both.
pub async fn serve_guarded<P: Participant>(
    participant: Arc<P>,
    participant_id: &str,
    listener: tokio::net::TcpListener,
    cluster: Vec<String>,
    recovery: RecoveryOptions,
    guard: Guard,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let Guard { tls, node_tokens } = guard;
    // Certificates are read again when their files change (every 10 s),
    // as a node's are: a rotation needs no restart.
    let mut reloaders = Vec::new();
    if let Some(t) = &tls {
        reloaders.push(t.spawn_reloader(TLS_RELOAD_INTERVAL, "participant"));
    }
    if let Some(t) = &recovery.tls {
        reloaders.push(t.spawn_reloader(TLS_RELOAD_INTERVAL, "participant's calls to the cluster"));
    }
    let recovery = spawn_recovery_with(participant.clone(), cluster, recovery);
    let policy: dtx_tls::AuthPolicy = if tls.is_some() || !node_tokens.is_empty() {
        participant_policy
    } else {
        |_| dtx_tls::Access::Open
    };
    let served = tonic::transport::Server::builder()
        .layer(
            dtx_tls::EdgeLayer::new("participant", node_tokens, policy)
                .marking_not_applied(dtx_proto::metadata::NOT_APPLIED_HEADER),
        )
        // Each call from the cluster runs in an `rpc` span with its `txid`
        // (`x-dtx-txid`) and the W3C trace it continues (`traceparent`).
        .layer(dtx_client::propagate::InboundTxidLayer)
        .add_service(
            dtx_proto::v1::participant_service_server::ParticipantServiceServer::new(ParticipantServer::new(
                participant,
                participant_id,
            )),
        )
        .serve_with_incoming_shutdown(dtx_tls::incoming(listener, tls), shutdown)
        .await;
    recovery.abort();
    for r in reloaders {
        r.abort();
    }
    served
}

/// How often a participant served with TLS looks at its certificate files.
pub const TLS_RELOAD_INTERVAL: Duration = Duration::from_secs(10);

/// Who may call each method of a participant served with TLS (or node
/// tokens): the cluster's nodes; the read-only `Inquire` and `Inspect`
/// (which reveals business transaction ids) also operators. A method
/// missing here is refused for everyone.
pub fn participant_policy(path: &str) -> dtx_tls::Access {
    use dtx_tls::Access;
    use dtx_tls::Role;
    match path.strip_prefix("/dtx.v1.ParticipantService/") {
        Some("Inquire" | "Inspect") => Access::Roles(&[Role::Node, Role::Operator]),
        Some("Prepare" | "Commit" | "Abort" | "CommitOnePhase" | "ApplyDecisions" | "PrepareMany") => {
            Access::Roles(&[Role::Node])
        }
        _ => Access::Roles(&[]),
    }
}

#[cfg(test)]
mod tests {
    use dtx_tls::Access;
    use dtx_tls::Role;

    use super::participant_policy;

    #[test]
    fn only_nodes_send_decisions_and_every_method_has_an_entry() {
        let text = include_str!("../../../proto/dtx/v1/participant.proto");
        let mut seen = 0;
        for line in text.lines() {
            let Some(rest) = line.trim().strip_prefix("rpc ") else {
                continue;
            };
            let method = rest.split('(').next().unwrap().trim();
            let Access::Roles(roles) = participant_policy(&format!("/dtx.v1.ParticipantService/{method}")) else {
                panic!("{method} is open")
            };
            assert!(roles.contains(&Role::Node), "{method}: nodes must be admitted");
            assert!(
                !roles.contains(&Role::Application),
                "{method}: applications must not be"
            );
            assert!(
                !roles.contains(&Role::Participant),
                "{method}: participants must not be"
            );
            assert_eq!(
                roles.contains(&Role::Operator),
                matches!(method, "Inquire" | "Inspect"),
                "{method}: only the read-only calls admit operators"
            );
            seen += 1;
        }
        assert!(seen >= 8, "{seen} methods found in participant.proto");
        assert_eq!(
            participant_policy("/dtx.v1.ParticipantService/Inspect"),
            Access::Roles(&[Role::Node, Role::Operator])
        );
        assert_eq!(
            participant_policy("/dtx.v1.ParticipantService/Nope"),
            Access::Roles(&[])
        );
    }
}
