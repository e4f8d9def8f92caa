//! TLS clusters for tests: nodes with certificates from a test authority.

use std::sync::Arc;
use std::time::Duration;

use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_testkit::pki::DevPki;
use dtx_tls::ClientTls;
use dtx_tls::Role;

use super::TestCluster;

/// A TLS cluster: nodes with their certificates, `client_auth` on the API
/// port as given, the supervisor's status calls as an operator.
pub fn tls_cluster(
    name: &str,
    pki: &Arc<DevPki>,
    client_auth: &str,
    tune: impl Fn(&mut coordinator::config::Config),
) -> TestCluster {
    let p = pki.clone();
    let auth = client_auth.to_string();
    let mut c = TestCluster::start_with(name, 3, move |cfg| {
        p.apply_node(cfg).expect("node certificate");
        cfg.tls.client_auth = auth.clone();
        tune(cfg);
    });
    let operator = pki.issue(Role::Operator, "supervisor", &[]).unwrap();
    c.procs.client_tls = Some(pki.client(&operator).unwrap());
    c
}

/// A client of `addrs` with `tls` and `token`, giving up on a call after
/// 5 s (2 s per attempt).
pub fn client_with(addrs: Vec<String>, tls: Option<Arc<ClientTls>>, token: Option<String>) -> Client {
    let mut cfg = ClientConfig::new(addrs);
    cfg.call_deadline = Duration::from_secs(5);
    cfg.attempt_timeout = Duration::from_secs(2);
    cfg.tls = tls;
    cfg.token = token;
    Client::new(cfg).unwrap()
}
