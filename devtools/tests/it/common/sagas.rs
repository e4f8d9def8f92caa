//! The order saga's step services as real processes (`coordinator
//! saga-step-serve`) and the outside world they call (`coordinator
//! outside-serve`: the payment provider and the e-mail sender), a
//! SagaService client that finds a node that answers, and the waits and
//! audits the saga tests share.
#![allow(dead_code)]

use std::path::Path;
use std::path::PathBuf;
use std::time::Duration;
use std::time::Instant;

use dtx_client::saga::SagaEnd;
use dtx_client::saga::SagaWait;
use dtx_client::Client;
use dtx_proto::v1 as pb;
use dtx_proto::v1::saga_service_client::SagaServiceClient;
use dtx_saga_shop::OrderInput;
use dtx_testkit::cluster::free_port;
use dtx_testkit::cluster::ServiceProcess;

use super::bin;
use super::TestCluster;

pub const ROLES: [&str; 3] = ["inventory", "payment", "email"];
/// The outside world: the payment provider, the e-mail sender.
pub const OUTSIDE: [&str; 2] = ["payment", "email"];

/// The three step services, each in its own process and data directory,
/// and the outside world they call.
pub struct SagaShop {
    pub dir: PathBuf,
    /// inventory, payment, email.
    pub services: Vec<ServiceProcess>,
    /// The payment provider, the e-mail sender (`<dir>/payment-provider`,
    /// `<dir>/email-sender`).
    pub world: Vec<ServiceProcess>,
    /// Extra environment per service (crash points).
    pub env: Vec<Vec<(String, String)>>,
    /// Times a service was found dead and started again.
    pub restarts: usize,
    /// The inventory's PostgreSQL database, when it keeps its stock there.
    pub inventory_postgres: Option<String>,
}

/// Extra flags per role.
#[derive(Clone, Default)]
pub struct ShopFlags {
    /// The payment step service loses its own gRPC replies.
    pub lose_replies_percent: u32,
    /// The payment provider loses its replies to the payment service.
    pub provider_lose_replies_percent: u32,
    pub fail_first_percent: u32,
    /// Start only these roles now (the rest with `start_role`).
    pub hold_back: Vec<&'static str>,
    /// The inventory keeps its stock in this PostgreSQL database
    /// (`saga-step-serve --postgres`) instead of its data directory.
    pub inventory_postgres: Option<String>,
}

impl SagaShop {
    pub async fn start(dir: &Path, flags: ShopFlags) -> SagaShop {
        let dir = dir.join("saga-shop");
        std::fs::create_dir_all(&dir).unwrap();
        let ip = "127.0.0.1";
        let mut world = Vec::new();
        for role in OUTSIDE {
            let addr = format!("{ip}:{}", free_port(ip).unwrap());
            let name = format!("{role}-outside");
            let mut args: Vec<std::ffi::OsString> = vec![
                "outside-serve".into(),
                "--role".into(),
                role.into(),
                "--listen".into(),
                addr.clone().into(),
                "--data".into(),
                dir.join(&name).into(),
            ];
            if role == "payment" && flags.provider_lose_replies_percent > 0 {
                args.push("--lose-replies-percent".into());
                args.push(flags.provider_lose_replies_percent.to_string().into());
            }
            let mut p = ServiceProcess::new(bin(), &dir, &name, &addr, args);
            p.start(&[]).unwrap();
            p.wait_started().await.unwrap();
            world.push(p);
        }
        let mut services = Vec::new();
        for role in ROLES {
            let addr = format!("{ip}:{}", free_port(ip).unwrap());
            let mut args: Vec<std::ffi::OsString> = vec![
                "saga-step-serve".into(),
                "--role".into(),
                role.into(),
                "--listen".into(),
                addr.clone().into(),
            ];
            match (role, &flags.inventory_postgres) {
                ("inventory", Some(conn)) => args.extend(["--postgres".into(), conn.into()]),
                _ => args.extend(["--data".into(), dir.join(role).into()]),
            }
            if role == "payment" {
                args.push("--provider".into());
                args.push(world[0].addr.clone().into());
            }
            if role == "email" {
                args.push("--sender".into());
                args.push(world[1].addr.clone().into());
            }
            if role == "payment" && flags.lose_replies_percent > 0 {
                args.push("--lose-replies-percent".into());
                args.push(flags.lose_replies_percent.to_string().into());
            }
            if role == "email" && flags.fail_first_percent > 0 {
                args.push("--fail-first-percent".into());
                args.push(flags.fail_first_percent.to_string().into());
            }
            services.push(ServiceProcess::new(bin(), &dir, role, &addr, args));
        }
        let mut shop = SagaShop {
            dir,
            services,
            world,
            env: vec![Vec::new(); 3],
            restarts: 0,
            inventory_postgres: flags.inventory_postgres.clone(),
        };
        for role in ROLES {
            if !flags.hold_back.contains(&role) {
                shop.start_role(role).await;
            }
        }
        shop
    }

    fn index(role: &str) -> usize {
        ROLES.iter().position(|r| *r == role).expect("a role of the shop")
    }

    pub fn addr(&self, role: &str) -> String {
        self.services[Self::index(role)].addr.clone()
    }

    pub fn service(&mut self, role: &str) -> &mut ServiceProcess {
        &mut self.services[Self::index(role)]
    }

    pub async fn start_role(&mut self, role: &str) {
        let i = Self::index(role);
        let env = self.env[i].clone();
        let s = &mut self.services[i];
        s.start(&env).unwrap();
        s.wait_started().await.unwrap();
    }

    /// Starts again every service that died (a crash point aborted it).
    pub async fn restart_dead(&mut self) {
        for role in ROLES {
            let i = Self::index(role);
            let started = self.services[i].pid().is_some();
            if started && !self.services[i].is_running() {
                self.restarts += 1;
                self.start_role(role).await;
            }
        }
    }

    /// The order saga's definition for these services.
    pub fn definition(&self) -> pb::SagaDefinition {
        dtx_saga_shop::order_saga_definition(&self.addr("inventory"), &self.addr("payment"), &self.addr("email"))
    }

    /// The order saga as `order-parks`: a failed charge parks the saga
    /// (recovery PARK) instead of compensating.
    pub fn parking_definition(&self) -> pb::SagaDefinition {
        let mut d = self.definition();
        d.name = "order-parks".into();
        d.steps[1].on_failure = vec![pb::RecoveryOption::Park as i32];
        d
    }

    /// The outside process of `role` (payment: the provider; email: the
    /// sender).
    pub fn outside(&mut self, role: &str) -> &mut ServiceProcess {
        let i = OUTSIDE.iter().position(|r| *r == role).expect("an outside role");
        &mut self.world[i]
    }

    /// Stops every service and outside process and audits their data (a
    /// store is not shared with a running process). Returns inventory,
    /// payment, email, then the payment provider's (the cards charged) and
    /// the e-mail sender's (the e-mails sent). Each must be clean, and the
    /// outside world must hold exactly what the step services recorded:
    /// per order, the charges and e-mails the services recorded are the
    /// ones the outside world made.
    pub fn audit_all(&mut self) -> Vec<dtx_saga_shop::Audit> {
        let mut out = Vec::new();
        let run = |args: &[&str], data: PathBuf| -> dtx_saga_shop::Audit {
            let mut cmd = std::process::Command::new(bin());
            cmd.args(args);
            match (args.contains(&"inventory"), &self.inventory_postgres) {
                (true, Some(conn)) => cmd.args(["--postgres", conn]),
                _ => cmd.arg("--data").arg(&data),
            };
            let o = cmd.output().unwrap();
            assert!(o.status.success(), "{args:?}: {}", super::output_text(&o));
            let a: dtx_saga_shop::Audit = serde_json::from_slice(&o.stdout).unwrap();
            assert!(
                a.ok(),
                "{}: problems {:?}, duplicate forward actions {}",
                a.role,
                a.problems,
                a.duplicate_forward_actions
            );
            a
        };
        for role in ROLES {
            let i = Self::index(role);
            self.services[i].stop(Duration::from_secs(5));
            out.push(run(&["saga-step-audit", "--role", role], self.dir.join(role)));
        }
        for (i, role) in OUTSIDE.iter().enumerate() {
            self.world[i].stop(Duration::from_secs(5));
            out.push(run(
                &["outside-audit", "--role", role],
                self.dir.join(format!("{role}-outside")),
            ));
        }
        let (pay, mail, provider, sender) = (&out[1], &out[2], &out[3], &out[4]);
        for (order, c) in &provider.charges {
            let here = pay.charges.get(order).map(|c| c.charges_applied).unwrap_or(0);
            assert!(
                c.charges_applied == here || pay.in_flight > 0,
                "order {order}: the provider charged {} time(s), the payment service recorded {here}",
                c.charges_applied
            );
        }
        for (order, c) in &sender.confirmations {
            let here = mail.confirmations.get(order).map(|c| c.applied).unwrap_or(0);
            assert!(
                c.applied == here || mail.in_flight > 0,
                "order {order}: the sender sent {} e-mail(s), the e-mail service recorded {here}",
                c.applied
            );
        }
        out
    }
}

/// Calls `f` on a SagaService client of each node in turn until one
/// answers something other than UNAVAILABLE, DEADLINE_EXCEEDED, UNKNOWN or
/// CANCELLED (a dead node, an election, a connection cut by a kill), for
/// up to `timeout`. Only for calls that may be repeated: reads, and writes
/// the tests make idempotent (a start by its key).
pub async fn call<T, F, Fut>(c: &TestCluster, timeout: Duration, mut f: F) -> Result<T, tonic::Status>
where
    F: FnMut(SagaServiceClient<tonic::transport::Channel>) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let until = Instant::now() + timeout;
    let addrs = c.procs.api_addrs();
    let mut last = tonic::Status::unavailable("no node tried");
    loop {
        for a in &addrs {
            let ep = tonic::transport::Endpoint::from_shared(format!("http://{a}"))
                .unwrap()
                .connect_timeout(Duration::from_millis(500))
                .timeout(Duration::from_secs(5));
            let Ok(ch) = ep.connect().await else { continue };
            match f(SagaServiceClient::new(ch)).await {
                Ok(r) => return Ok(r.into_inner()),
                Err(s)
                    if matches!(
                        s.code(),
                        tonic::Code::Unavailable
                            | tonic::Code::DeadlineExceeded
                            | tonic::Code::Unknown
                            | tonic::Code::Cancelled
                    ) =>
                {
                    last = s
                }
                Err(s) => return Err(s),
            }
        }
        if Instant::now() >= until {
            return Err(last);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub async fn register(c: &TestCluster, d: pb::SagaDefinition) {
    call(c, Duration::from_secs(30), |mut cl| {
        let d = d.clone();
        async move {
            cl.register_definition(pb::RegisterSagaDefinitionRequest { definition: Some(d) })
                .await
        }
    })
    .await
    .expect("register the definition");
}

pub fn order(n: usize, sku: u32, qty: u64, customer: u32, amount: u64) -> OrderInput {
    OrderInput {
        order: format!("o-{n}"),
        sku: format!("sku-{sku}"),
        qty,
        customer: format!("c-{customer}"),
        amount,
    }
}

/// Starts an order saga of `definition`@1 with `input` (key = the order).
pub async fn start(c: &TestCluster, definition: &str, input: &OrderInput, auth: Option<pb::SagaAuthorization>) -> u64 {
    let req = pb::StartSagaRequest {
        definition: definition.to_string(),
        version: 1,
        idempotency_key: input.order.clone(),
        input: input.to_json(),
        authorization: auth,
        deadline_ms: 0,
    };
    call(c, Duration::from_secs(30), |mut cl| {
        let r = req.clone();
        async move { cl.start_saga(r).await }
    })
    .await
    .expect("start a saga")
    .saga_id
}

pub async fn get(c: &TestCluster, id: u64) -> pb::SagaView {
    call(c, Duration::from_secs(30), |mut cl| async move {
        cl.get_saga(pb::GetSagaRequest { saga_id: id }).await
    })
    .await
    .expect("read a saga")
}

pub fn state(v: &pb::SagaView) -> pb::SagaState {
    pb::SagaState::try_from(v.state).unwrap()
}

/// Waits until saga `id` is in one of `states`, restarting dead step
/// services meanwhile; panics with the saga's view after `timeout`.
pub async fn wait_state(
    c: &TestCluster,
    shop: &mut SagaShop,
    id: u64,
    states: &[pb::SagaState],
    timeout: Duration,
) -> pb::SagaView {
    let until = Instant::now() + timeout;
    loop {
        shop.restart_dead().await;
        let v = get(c, id).await;
        if states.contains(&state(&v)) {
            return v;
        }
        if Instant::now() >= until {
            panic!("saga {id} did not reach {states:?} in {timeout:?}: {v:#?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub const ENDED: [pb::SagaState; 2] = [pb::SagaState::Completed, pb::SagaState::Compensated];

pub fn outcome(c: Option<&pb::StepCallView>) -> pb::StepOutcome {
    c.map(|c| pb::StepOutcome::try_from(c.outcome).unwrap())
        .unwrap_or(pb::StepOutcome::Unspecified)
}

/// Reconciliations over every call of a saga.
pub fn reconciliations(v: &pb::SagaView) -> u32 {
    v.steps
        .iter()
        .flat_map(|s| [s.forward.as_ref(), s.compensation.as_ref()])
        .flatten()
        .map(|c| c.reconciliations)
        .sum()
}

/// The view of saga `id` once `cond` holds of it; panics with the last view
/// after `timeout`.
pub async fn wait_for(
    client: &Client,
    id: u64,
    timeout: Duration,
    what: &str,
    cond: impl Fn(&pb::SagaView) -> bool,
) -> pb::SagaView {
    let until = tokio::time::Instant::now() + timeout;
    let mut last = None;
    loop {
        if let Ok(v) = client.saga(id).await {
            if cond(&v) {
                return v;
            }
            last = Some(v);
        }
        if tokio::time::Instant::now() >= until {
            panic!("saga {id}: {what} not seen in {timeout:?}: {last:#?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits for the end of saga `id`; panics when it is not `want`.
pub async fn ends(client: &Client, id: u64, want: SagaEnd) -> pb::SagaView {
    match client.wait_saga(id, Duration::from_secs(90)).await {
        Ok(SagaWait::Ended { end, view }) if end == want => view,
        other => panic!("saga {id} should end {want:?}: {other:#?}"),
    }
}
