//! The mapping of the node's one error type (`ApiError`, defined beside
//! `NodeCtx` so the driver and the context need nothing of the API) to gRPC
//! status codes, in one place (docs/api.md lists the model).

use tonic::metadata::MetadataValue;
use tonic::Code;
use tonic::Status;

pub use crate::ctx::ApiError;

pub use dtx_proto::metadata::FORWARDED_HEADER;
use dtx_proto::metadata::LEADER_ADDR_HEADER;
use dtx_proto::metadata::LEADER_ID_HEADER;
pub use dtx_proto::metadata::NOT_APPLIED_HEADER;

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Status {
        let code = match &e {
            ApiError::InvalidArgument(_) => Code::InvalidArgument,
            ApiError::NotFound(_) => Code::NotFound,
            ApiError::AlreadyExists(_) => Code::AlreadyExists,
            ApiError::FailedPrecondition(_) | ApiError::BranchRefused { .. } => Code::FailedPrecondition,
            ApiError::PermissionDenied(_) => Code::PermissionDenied,
            ApiError::NotLeader { .. } | ApiError::NoLeader(_) | ApiError::Unavailable(_) => Code::Unavailable,
            ApiError::Unknown(_) => Code::DeadlineExceeded,
            ApiError::Internal(_) => Code::Internal,
        };
        let mut status = Status::new(code, e.to_string());
        let not_applied = matches!(
            e,
            ApiError::NoLeader(_)
                | ApiError::NotLeader { proposed: false, .. }
                | ApiError::InvalidArgument(_)
                | ApiError::NotFound(_)
                | ApiError::AlreadyExists(_)
                | ApiError::FailedPrecondition(_)
                | ApiError::BranchRefused { .. }
                | ApiError::PermissionDenied(_)
        );
        if not_applied {
            status
                .metadata_mut()
                .insert(NOT_APPLIED_HEADER, MetadataValue::from_static("1"));
        }
        if let ApiError::BranchRefused { kind, .. } = &e {
            dtx_proto::metadata::set_branch_refusal(&mut status, *kind);
        }
        if let ApiError::NotLeader {
            leader_id,
            leader_api_addr,
            ..
        } = &e
        {
            let md = status.metadata_mut();
            if let Some(id) = leader_id {
                md.insert(LEADER_ID_HEADER, MetadataValue::from(*id));
            }
            if let Some(addr) = leader_api_addr.as_deref().and_then(|a| a.parse().ok()) {
                md.insert(LEADER_ADDR_HEADER, addr);
            }
        }
        status
    }
}
