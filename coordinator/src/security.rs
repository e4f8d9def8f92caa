//! TLS and authorisation of a node (ADR 0016): the TLS settings
//! of its two ports and of its outgoing calls, loaded from the config with
//! clear start-up errors, and the method tables saying which roles may
//! call what.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use dtx_tls::client::ClientTlsFiles;
use dtx_tls::edge::Bearer;
use dtx_tls::files::KeyPairFiles;
use dtx_tls::server::ServerTlsFiles;
use dtx_tls::Access;
use dtx_tls::ClientAuth;
use dtx_tls::ClientTls;
use dtx_tls::EdgeLayer;
use dtx_tls::Identity;
use dtx_tls::NodeCheck;
use dtx_tls::RateLimit;
use dtx_tls::Role;
use dtx_tls::ServerTls;
use dtx_tls::Tokens;
use tracing::warn;

use crate::config::Config;

/// Header a node adds when it forwards a call to the leader: the identity
/// (`<role>/<name>`) the forwarding node authenticated. The leader takes
/// it only from a caller with the node role.
pub const ON_BEHALF_OF_HEADER: &str = "x-dtx-on-behalf-of";

/// A node's TLS settings and accepted tokens.
pub struct Security {
    /// The API port's TLS (client certificates as `tls.client_auth` says).
    pub api_tls: Option<Arc<ServerTls>>,
    /// The Raft port's TLS (a node certificate always required).
    pub raft_tls: Option<Arc<ServerTls>>,
    /// Outgoing calls: to other nodes and to participants, with this
    /// node's certificate.
    pub client_tls: Option<Arc<ClientTls>>,
    pub tokens: Tokens,
    /// Calls must prove who they are (TLS on, or tokens configured).
    pub auth: bool,
    /// The token this node sends to participants (`auth.participant_token_file`).
    pub participant_token: Bearer,
}

impl Security {
    /// Reads and checks every file the config names. The errors say which
    /// file and what is wrong (unreadable, expired, a key that does not
    /// match, a certificate that names another node).
    pub fn load(config: &Config) -> anyhow::Result<Security> {
        let mut tokens = Vec::new();
        for t in &config.auth.tokens {
            tokens.push(t.entry().map_err(|e| anyhow::anyhow!("auth.tokens: {e}"))?);
        }
        let tokens = Tokens::new(tokens);
        let participant_token = participant_token(config)?;
        let t = &config.tls;
        let (Some(cert), Some(key), Some(ca)) = (&t.cert, &t.key, &t.ca) else {
            if tokens.is_empty() {
                warn!(
                    api_addr = %config.api_addr,
                    raft_addr = %config.raft_addr,
                    "no TLS and no tokens: anyone who reaches these ports can begin, decide, resolve and change membership; see docs/operations.md, \"Certificates and tokens\""
                );
            } else {
                warn!("no TLS: bearer tokens and every message travel in plain text");
            }
            return Ok(Security {
                api_tls: None,
                raft_tls: None,
                client_tls: None,
                auth: !tokens.is_empty(),
                tokens,
                participant_token,
            });
        };
        let own = KeyPairFiles {
            cert: cert.clone(),
            key: key.clone(),
        };
        let client_auth = ClientAuth::parse(&t.client_auth).map_err(|e| anyhow::anyhow!("tls.{e}"))?;
        let api_tls = ServerTls::load(ServerTlsFiles {
            own: own.clone(),
            ca: ca.clone(),
            client_auth,
        })
        .context("TLS of the API port (tls.cert, tls.key, tls.ca)")?;
        let raft_tls = ServerTls::load(ServerTlsFiles {
            own: own.clone(),
            ca: ca.clone(),
            client_auth: ClientAuth::Required,
        })
        .context("TLS of the Raft port")?;
        let client_tls = ClientTls::load(ClientTlsFiles {
            ca: ca.clone(),
            own: Some(own.clone()),
            server_name: None,
        })
        .context("TLS of this node's calls to other nodes and participants")?;
        check_own_identity(&own, config.node_id)?;
        Ok(Security {
            api_tls: Some(api_tls),
            raft_tls: Some(raft_tls),
            client_tls: Some(client_tls),
            tokens,
            auth: true,
            participant_token,
        })
    }

    /// Watches the files every `interval` (see `ServerTls::spawn_reloader`).
    pub fn spawn_reloaders(&self, interval: Duration) -> Vec<tokio::task::JoinHandle<()>> {
        if interval.is_zero() {
            return Vec::new();
        }
        let mut v = Vec::new();
        if let Some(t) = &self.api_tls {
            v.push(t.spawn_reloader(interval, "api"));
        }
        if let Some(t) = &self.raft_tls {
            v.push(t.spawn_reloader(interval, "raft"));
        }
        if let Some(t) = &self.client_tls {
            v.push(t.spawn_reloader(interval, "outgoing"));
        }
        v
    }

    /// The layer in front of the API port's services. `members` says
    /// which node identities are honoured ([`member_check`]).
    pub fn api_layer(&self, api: &crate::config::ApiConfig, members: Option<NodeCheck>) -> EdgeLayer {
        let rate = (api.requests_per_s_per_identity > 0).then_some(RateLimit {
            per_s: api.requests_per_s_per_identity as f64,
            burst: api.request_burst_per_identity as f64,
        });
        EdgeLayer::new(
            "api",
            self.tokens.clone(),
            if self.auth { api_policy } else { open_policy },
        )
        .with_rate_limit(rate)
        .with_node_check(members)
        .marking_not_applied(dtx_proto::metadata::NOT_APPLIED_HEADER)
    }

    /// The layer in front of the Raft port: node certificates only, when
    /// TLS is on (without TLS the Raft port is open: protect it with TLS
    /// or the network).
    pub fn raft_layer(&self, members: Option<NodeCheck>) -> EdgeLayer {
        let tls = self.raft_tls.is_some();
        EdgeLayer::new("raft", Tokens::default(), if tls { raft_policy } else { open_policy })
            .with_node_check(members)
            .marking_not_applied(dtx_proto::metadata::NOT_APPLIED_HEADER)
    }
}

/// Which node identities a node honours (ADR 0037):
/// `dtx://node/<id>` only for an id in its current membership (voters and
/// learners of the membership its log holds last), so a never-member and
/// a removed member are refused, on the Raft port and on the API port (where
/// a node's `x-dtx-on-behalf-of` is then taken from current members only).
///
/// `raft_port`: a node that belongs to no membership yet (started on an
/// empty data directory, waiting to be added) honours any node on its Raft
/// port, since the leader adding it must reach it before it knows who the
/// members are; it has no state to protect and serves nothing.
pub fn member_check(raft: crate::raft::Raft, raft_port: bool) -> NodeCheck {
    Arc::new(move |name: &str| {
        let metrics = raft.metrics();
        let m = metrics.borrow();
        let members: Vec<u64> = m.membership_config.membership().nodes().map(|(id, _)| *id).collect();
        member_admits(&members, name, raft_port)
    })
}

/// [`member_check`]'s rule, for `members` (the ids of the current
/// membership).
fn member_admits(members: &[u64], name: &str, raft_port: bool) -> Result<(), String> {
    let Some(id) = dtx_tls::identity::node_id_of(name) else {
        return Err(format!("{name:?} is not a node id"));
    };
    if members.contains(&id) || (raft_port && members.is_empty()) {
        return Ok(());
    }
    let list: Vec<String> = members.iter().map(u64::to_string).collect();
    Err(format!(
        "node {id} is not a member of this cluster (members: {}); a node identity is honoured only for a current member",
        if list.is_empty() { "none yet".to_string() } else { list.join(", ") }
    ))
}

/// The token of `auth.participant_token_file`, if set: read and checked
/// at start.
fn participant_token(config: &Config) -> anyhow::Result<Bearer> {
    let Some(path) = &config.auth.participant_token_file else {
        return Ok(Bearer::default());
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("auth.participant_token_file {}", path.display()))?;
    let token = text.trim();
    anyhow::ensure!(
        !token.is_empty(),
        "auth.participant_token_file {} is empty",
        path.display()
    );
    Bearer::new(Some(token)).map_err(|e| anyhow::anyhow!("auth.participant_token_file {}: {e}", path.display()))
}

/// The node's certificate must name this node (`dtx://node/<node_id>`):
/// other nodes and participants admit it by that identity.
fn check_own_identity(own: &KeyPairFiles, node_id: u64) -> anyhow::Result<()> {
    let certs = dtx_tls::files::load_certs("certificate", &own.cert)?;
    let want = format!("node/{node_id}");
    match dtx_tls::identity::identity_of_cert(&certs[0]) {
        Ok(id) if id.label() == want => Ok(()),
        Ok(id) => anyhow::bail!(
            "certificate {} names {id}, but this is node {node_id}: a node's certificate must name dtx://node/{node_id}",
            own.cert.display()
        ),
        Err(e) => anyhow::bail!("certificate {}: {e}; a node's certificate must name dtx://node/{node_id}", own.cert.display()),
    }
}

fn open_policy(_: &str) -> Access {
    Access::Open
}

const APP: &[Role] = &[Role::Application, Role::Node];
const ENLIST: &[Role] = &[Role::Application, Role::Participant, Role::Node];
const READ: &[Role] = &[Role::Application, Role::Participant, Role::Operator, Role::Node];
const STATUS: &[Role] = &[Role::Application, Role::Operator, Role::Node];
const ADMIN: &[Role] = &[Role::Operator, Role::Node];
const SAGA: &[Role] = &[Role::Application, Role::Operator, Role::Node];
const NODE: &[Role] = &[Role::Node];
/// Any authenticated caller (not an anonymous one).
const ANY_ROLE: &[Role] = &[Role::Application, Role::Participant, Role::Operator, Role::Node];

/// `grpc.health.v1` is open to every caller on both ports: probes (a
/// Kubernetes probe, a load balancer) carry no token and no certificate.
/// It tells only whether the node serves (`raft::serving`). On a TLS port
/// the caller still speaks TLS (and trusts the node's authority); it need
/// not present a certificate, even where `tls.client_auth = "required"`:
/// the handshake asks for one, and the edge layer, not the handshake,
/// refuses a call without one to any other method.
fn health(path: &str) -> bool {
    matches!(path, "/grpc.health.v1.Health/Check" | "/grpc.health.v1.Health/Watch")
}

/// Who may call each method of the API port. Nodes may call all of them:
/// a follower forwards its callers' calls to the leader (and names the
/// caller in [`ON_BEHALF_OF_HEADER`]).
pub fn api_policy(path: &str) -> Access {
    if health(path) {
        return Access::Open;
    }
    let Some((service, method)) = path.trim_start_matches('/').split_once('/') else {
        return Access::Roles(&[]);
    };
    Access::Roles(match (service, method) {
        ("dtx.v1.Coordinator", "Begin" | "BeginAndCommit" | "Commit" | "Abort") => APP,
        // A branch registers itself (ADR 0046) and asks what to do with
        // its prepared work: who may enlist may do both.
        ("dtx.v1.Coordinator", "Enlist" | "RegisterBranch" | "GetBranchDecision") => ENLIST,
        ("dtx.v1.Coordinator", "GetDecision" | "GetDecisions") => READ,
        ("dtx.v1.Coordinator", "Status") => STATUS,
        (
            "dtx.v1.Admin",
            "ClusterStatus" | "AddNode" | "RemoveNode" | "TriggerSnapshot" | "Resolve" | "ListTransactions"
            | "DropParticipant" | "ForgetTransaction" | "Backup" | "SettleOther",
        ) => ADMIN,
        // Sagas: applications register definitions, start sagas
        // and read them; operators read them too and act on parked ones.
        ("dtx.v1.SagaService", "RegisterDefinition" | "StartSaga" | "GetSaga" | "ListSagas" | "ListDefinitions") => {
            SAGA
        }
        // Operators act on any saga; an application may only cancel its
        // own (the handler refuses it every other action).
        ("dtx.v1.SagaService", "OperateSaga") => SAGA,
        // A PENDING step is completed by whoever hears of its end: the
        // application (its own sagas), the step service, an operator.
        ("dtx.v1.SagaService", "CompleteStep") => ANY_ROLE,
        // Server reflection (the API's own descriptors, for grpcurl and
        // the like): any authenticated caller.
        (
            "grpc.reflection.v1.ServerReflection" | "grpc.reflection.v1alpha.ServerReflection",
            "ServerReflectionInfo",
        ) => ANY_ROLE,
        _ => &[],
    })
}

/// Who may call each method of the Raft port: nodes only, but for the
/// health service (anyone).
pub fn raft_policy(path: &str) -> Access {
    if health(path) {
        Access::Open
    } else if path.starts_with("/dtx.v1.RaftTransport/") {
        Access::Roles(NODE)
    } else {
        Access::Roles(&[])
    }
}

/// The identity a call is made for: the authenticated caller's, or, when
/// the caller is a node forwarding a call, the identity it names in
/// [`ON_BEHALF_OF_HEADER`] (the edge layer admitted the node only as a
/// current member, [`member_check`]; tokens never carry the node role,
/// `TokenConfig::entry`). None when authentication is off.
pub fn caller<T>(req: &tonic::Request<T>) -> Option<Identity> {
    let id = dtx_tls::edge::caller(req)?.clone();
    if id.role != Role::Node {
        return Some(id);
    }
    let Some(label) = req.metadata().get(ON_BEHALF_OF_HEADER).and_then(|v| v.to_str().ok()) else {
        return Some(id);
    };
    match label
        .split_once('/')
        .and_then(|(role, name)| Some((Role::parse(role).ok()?, name)))
    {
        Some((role, name)) if dtx_tls::identity::check_identity(role, name).is_ok() => Some(Identity {
            role,
            name: name.to_string(),
            proof: id.proof,
        }),
        _ => Some(id),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_api_method_has_an_entry_and_unknown_ones_are_refused() {
        for (path, role, allowed) in [
            ("/dtx.v1.Coordinator/Begin", Role::Application, true),
            ("/dtx.v1.Coordinator/Begin", Role::Participant, false),
            ("/dtx.v1.Coordinator/Begin", Role::Operator, false),
            ("/dtx.v1.Coordinator/Enlist", Role::Participant, true),
            ("/dtx.v1.Coordinator/GetDecisions", Role::Participant, true),
            ("/dtx.v1.Coordinator/RegisterBranch", Role::Participant, true),
            ("/dtx.v1.Coordinator/RegisterBranch", Role::Operator, false),
            ("/dtx.v1.Coordinator/GetBranchDecision", Role::Participant, true),
            ("/dtx.v1.Coordinator/Status", Role::Participant, false),
            ("/dtx.v1.Admin/Resolve", Role::Operator, true),
            ("/dtx.v1.Admin/Resolve", Role::Application, false),
            ("/dtx.v1.Admin/SettleOther", Role::Operator, true),
            ("/dtx.v1.Admin/SettleOther", Role::Participant, false),
            ("/dtx.v1.Admin/RemoveNode", Role::Application, false),
            ("/dtx.v1.Admin/ClusterStatus", Role::Participant, false),
            ("/dtx.v1.Admin/Unknown", Role::Operator, false),
            // Reflection: any role, but only its one method.
            (
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                Role::Participant,
                true,
            ),
            (
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                Role::Application,
                true,
            ),
            ("/grpc.reflection.v1.ServerReflection/Other", Role::Operator, false),
            ("/grpc.health.v1.Health/Other", Role::Operator, false),
            ("nonsense", Role::Node, false),
        ] {
            let Access::Roles(r) = api_policy(path) else {
                panic!("{path} open")
            };
            assert_eq!(r.contains(&role), allowed, "{path} {role}");
        }
        assert_eq!(raft_policy("/dtx.v1.RaftTransport/Vote"), Access::Roles(NODE));
        assert_eq!(raft_policy("/dtx.v1.Coordinator/Begin"), Access::Roles(&[]));
        assert_eq!(
            raft_policy("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"),
            Access::Roles(&[]),
            "no reflection on the Raft port"
        );
    }

    /// A node identity is honoured only for a current member's id; a node
    /// with no membership yet admits any node on its Raft port only (the
    /// leader adding it must reach it).
    #[test]
    fn only_current_members_are_honoured_as_nodes() {
        let members = [1, 2, 3];
        for raft_port in [false, true] {
            assert_eq!(member_admits(&members, "2", raft_port), Ok(()));
            let e = member_admits(&members, "9", raft_port).unwrap_err();
            assert!(
                e.contains("node 9 is not a member") && e.contains("members: 1, 2, 3"),
                "{e}"
            );
            assert!(member_admits(&members, "x", raft_port).is_err());
        }
        assert_eq!(member_admits(&[], "9", true), Ok(()), "a node waiting to be added");
        let e = member_admits(&[], "9", false).unwrap_err();
        assert!(e.contains("none yet"), "{e}");
    }

    #[test]
    fn health_is_open_to_anyone_on_both_ports() {
        // Was once refused for every role: probes carry no
        // identity, and health says only whether the node serves.
        for path in ["/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"] {
            assert_eq!(api_policy(path), Access::Open, "{path} on the API port");
            assert_eq!(raft_policy(path), Access::Open, "{path} on the Raft port");
        }
    }

    #[test]
    fn every_method_in_the_protos_is_in_the_table() {
        // A method added to a .proto without an entry would be refused for
        // everyone; this catches it at once.
        let protos = [
            (
                "dtx.v1.Coordinator",
                include_str!("../../proto/dtx/v1/coordinator.proto"),
            ),
            ("dtx.v1.Admin", include_str!("../../proto/dtx/v1/admin.proto")),
            // Only the first service of saga.proto is served by nodes
            // (SagaStepService is the step services').
            (
                "dtx.v1.SagaService",
                include_str!("../../proto/dtx/v1/saga.proto")
                    .split("service SagaStepService")
                    .next()
                    .unwrap(),
            ),
        ];
        for (service, text) in protos {
            for line in text.lines() {
                let Some(rest) = line.trim().strip_prefix("rpc ") else {
                    continue;
                };
                let method = rest.split('(').next().unwrap().trim();
                let path = format!("/{service}/{method}");
                assert_ne!(api_policy(&path), Access::Roles(&[]), "{path} has no entry");
            }
        }
    }
}
