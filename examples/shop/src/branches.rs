//! The shop written as branches (docs/protocol.md, "Branches"): each
//! service does its SQL in its own request handler and answers with
//! results, and the order service drives the transaction.
//!
//! - `InventoryService.Reserve` and `PaymentService.Charge`
//!   ([`ServiceApi`]): called with the txid and incarnation in the call's
//!   metadata, they run the same SQL as the Prepare-driven handler
//!   ([`crate::prepare_order`]) in a PostgreSQL transaction bound to the
//!   txid, read what the order leaves (stock, balance) in it, then prepare
//!   it (`PREPARE TRANSACTION`) and register with their vote before
//!   answering.
//! - `OrderService.PlaceOrder` ([`OrdersApi`]): begins the transaction
//!   (the order id is its idempotency key), calls both with the txid,
//!   records the order in its own database as a branch too, and commits;
//!   with every member a branch, the commit is one write and no Prepare
//!   is sent. Any refusal or error aborts it.
//!
//! Each service names itself once (`shop-serve --role`): its participant
//! id, and the address the cluster delivers decisions to.

use std::sync::Arc;
use std::time::Duration;

use dtx_client::Client;
use dtx_client::ClientError;
use dtx_client::TxOutcome;
use participant_sdk::branch::BranchError;
use participant_sdk::branch::BranchIdentity;
use participant_sdk::log::Vote;
use participant_sdk::postgres::PgParticipant;
use participant_sdk::GlobalTxid;
use tonic::transport::Channel;
use tonic::Request;
use tonic::Response;
use tonic::Status;

use crate::pb;
use crate::Order;
use crate::Role;
use crate::ShopHandler;

/// The transaction's timeout: past it the cluster aborts an order whose
/// commit was never asked for (the order service died meanwhile).
pub const ORDER_TIMEOUT_MS: u64 = 10_000;

/// How long the order service waits for each of the other services.
pub const CALL_TIMEOUT_MS: u64 = 5_000;

/// One service's part of an order, as a branch.
pub struct ServiceApi {
    role: Role,
    pg: Arc<PgParticipant<ShopHandler>>,
    cluster: Arc<Client>,
    who: BranchIdentity,
}

impl ServiceApi {
    /// `role`'s API on its participant `pg`, registering through
    /// `cluster`; the cluster reaches its participant service at
    /// `participant_addr`.
    pub fn new(role: Role, pg: Arc<PgParticipant<ShopHandler>>, cluster: Arc<Client>, participant_addr: &str) -> Self {
        ServiceApi {
            role,
            pg,
            cluster,
            who: BranchIdentity {
                participant_id: role.id().to_string(),
                address: participant_addr.to_string(),
            },
        }
    }

    /// Runs this service's part of `order` as a branch of `txid`: the
    /// SQL, what it leaves (units available for the inventory, the balance
    /// for the payment service, 0 for the orders), the prepare and the
    /// registration. A refusal is FAILED_PRECONDITION with the reason.
    pub async fn run(&self, txid: GlobalTxid, order: &Order) -> Result<i64, Status> {
        let mut conn = self
            .pg
            .branch_connection()
            .await
            .map_err(|e| Status::from(BranchError::from(e)))?;
        let branch = self.pg.begin_branch(&mut conn, txid).await.map_err(Status::from)?;
        let sql_failed =
            |e: tokio_postgres::Error| Status::internal(format!("{}: the order's SQL failed: {e}", self.role));
        let verdict = crate::prepare_order(self.role, branch.tx(), txid.txid, order)
            .await
            .map_err(sql_failed)?;
        let mut left = 0;
        if verdict.vote == Vote::Yes {
            let query = match self.role {
                Role::Orders => None,
                Role::Inventory => Some(("SELECT available::bigint FROM stock WHERE sku = $1", &order.sku)),
                Role::Payment => Some(("SELECT amount FROM balances WHERE customer = $1", &order.customer)),
            };
            if let Some((sql, key)) = query {
                left = branch
                    .tx()
                    .query_one(sql, &[key])
                    .await
                    .map_err(sql_failed)?
                    .get::<_, i64>(0);
            }
        }
        let joined = branch
            .join(verdict, &self.cluster, &self.who)
            .await
            .map_err(Status::from)?;
        match joined.vote {
            Vote::Yes => Ok(left),
            Vote::No | Vote::ReadOnly => Err(Status::failed_precondition(format!(
                "{} refused order {}: {}",
                self.role, order.id, joined.reason
            ))),
        }
    }

    async fn serve_call(&self, req: Request<Option<pb::Order>>) -> Result<i64, Status> {
        let txid = participant_sdk::branch::transaction_of(&req).map_err(Status::from)?;
        let order = req
            .into_inner()
            .ok_or_else(|| Status::invalid_argument("the request has no order"))?;
        let order = Order::from_pb(order).map_err(Status::invalid_argument)?;
        self.run(txid, &order).await
    }
}

#[tonic::async_trait]
impl pb::inventory_service_server::InventoryService for ServiceApi {
    async fn reserve(&self, req: Request<pb::ReserveRequest>) -> Result<Response<pb::ReserveReply>, Status> {
        let req = req.map(|r| r.order);
        let left = self.serve_call(req).await?;
        Ok(Response::new(pb::ReserveReply {
            available_after: left as i32,
        }))
    }
}

#[tonic::async_trait]
impl pb::payment_service_server::PaymentService for ServiceApi {
    async fn charge(&self, req: Request<pb::ChargeRequest>) -> Result<Response<pb::ChargeReply>, Status> {
        let req = req.map(|r| r.order);
        let left = self.serve_call(req).await?;
        Ok(Response::new(pb::ChargeReply { balance_after: left }))
    }
}

/// The order service's API: places orders as transactions of three
/// branches.
pub struct OrdersApi {
    own: ServiceApi,
    inventory: Channel,
    payment: Channel,
}

impl OrdersApi {
    /// The order service on `own` (its own branch, role orders), calling
    /// the inventory and payment APIs at `inventory` and `payment`.
    pub fn new(own: ServiceApi, inventory: &str, payment: &str) -> anyhow::Result<Self> {
        let lazy = |addr: &str| -> anyhow::Result<Channel> {
            Ok(tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
                .connect_timeout(Duration::from_millis(500))
                .connect_lazy())
        };
        Ok(OrdersApi {
            own,
            inventory: lazy(inventory)?,
            payment: lazy(payment)?,
        })
    }

    fn call<T>(&self, txid: GlobalTxid, body: T) -> Request<T> {
        let mut req = Request::new(body);
        dtx_proto::attach_txid(&mut req, txid.txid);
        dtx_proto::attach_incarnation(&mut req, txid.incarnation);
        req.set_timeout(Duration::from_millis(CALL_TIMEOUT_MS));
        req
    }

    fn cluster(&self) -> &Client {
        &self.own.cluster
    }
}

fn reply(txid: u64, outcome: pb::OrderOutcome, reason: String) -> pb::PlaceOrderReply {
    pb::PlaceOrderReply {
        txid,
        outcome: outcome as i32,
        reason,
        ..Default::default()
    }
}

#[tonic::async_trait]
impl pb::order_service_server::OrderService for OrdersApi {
    async fn place_order(&self, req: Request<pb::PlaceOrderRequest>) -> Result<Response<pb::PlaceOrderReply>, Status> {
        let order = req
            .into_inner()
            .order
            .ok_or_else(|| Status::invalid_argument("the request has no order"))?;
        let order = Order::from_pb(order).map_err(Status::invalid_argument)?;
        let began = match self.cluster().begin(&order.id, ORDER_TIMEOUT_MS, b"order").await {
            Ok(b) => b,
            Err(ClientError::Unknown(why)) => {
                return Ok(Response::new(reply(0, pb::OrderOutcome::Unknown, why)));
            }
            Err(e) => {
                return Err(Status::unavailable(format!(
                    "cannot begin the order's transaction: {e}"
                )))
            }
        };
        let txid = GlobalTxid::new(began.incarnation, began.txid);
        if began.existing {
            // Placed before under this id (a retry): its decision, not a
            // second attempt.
            let outcome = match self.cluster().decision(began.txid).await {
                Ok(dtx_client::DecisionRead::Committed) => pb::OrderOutcome::Committed,
                Ok(dtx_client::DecisionRead::Aborted | dtx_client::DecisionRead::UnknownPresumedAbort) => {
                    pb::OrderOutcome::Aborted
                }
                _ => pb::OrderOutcome::Unknown,
            };
            return Ok(Response::new(reply(
                began.txid,
                outcome,
                format!("order {} was placed before, in transaction {}", order.id, began.txid),
            )));
        }
        let mut inventory = pb::inventory_service_client::InventoryServiceClient::new(self.inventory.clone());
        let mut payment = pb::payment_service_client::PaymentServiceClient::new(self.payment.clone());
        let (reserved, charged, recorded) = tokio::join!(
            inventory.reserve(self.call(
                txid,
                pb::ReserveRequest {
                    order: Some(order.to_pb())
                }
            )),
            payment.charge(self.call(
                txid,
                pb::ChargeRequest {
                    order: Some(order.to_pb())
                }
            )),
            self.own.run(txid, &order),
        );
        let refusal = [
            reserved.as_ref().err().map(|s| format!("inventory: {}", s.message())),
            charged.as_ref().err().map(|s| format!("payment: {}", s.message())),
            recorded.as_ref().err().map(|s| format!("orders: {}", s.message())),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>();
        if !refusal.is_empty() {
            let why = refusal.join("; ");
            // Only this handler asks to commit, and it will not: the
            // transaction aborts (now, or at its deadline if this call
            // does not get through).
            let outcome = match self.cluster().abort(began.txid, &why).await {
                Ok(TxOutcome::Aborted) => pb::OrderOutcome::Aborted,
                Ok(TxOutcome::Committed) => pb::OrderOutcome::Committed,
                _ => pb::OrderOutcome::Unknown,
            };
            return Ok(Response::new(reply(began.txid, outcome, why)));
        }
        let outcome = match self.cluster().commit(began.txid).await {
            Ok(TxOutcome::Committed) => pb::OrderOutcome::Committed,
            Ok(TxOutcome::Aborted) => {
                let note = self
                    .cluster()
                    .status(began.txid)
                    .await
                    .ok()
                    .and_then(|s| s.decision)
                    .map(|d| d.note)
                    .unwrap_or_default();
                return Ok(Response::new(reply(began.txid, pb::OrderOutcome::Aborted, note)));
            }
            Ok(TxOutcome::Unknown) => pb::OrderOutcome::Unknown,
            Err(e) => {
                return Ok(Response::new(reply(
                    began.txid,
                    pb::OrderOutcome::Unknown,
                    e.to_string(),
                )))
            }
        };
        let (reserved, charged) = (
            reserved.map(|r| r.into_inner().available_after).unwrap_or_default(),
            charged.map(|r| r.into_inner().balance_after).unwrap_or_default(),
        );
        Ok(Response::new(pb::PlaceOrderReply {
            txid: began.txid,
            outcome: outcome as i32,
            available_after: reserved,
            balance_after: charged,
            reason: String::new(),
        }))
    }
}
