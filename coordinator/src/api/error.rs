//! The API layer's one error type and its mapping to gRPC status codes, in
//! one place (docs/api.md lists the model).

use tonic::metadata::MetadataValue;
use tonic::Code;
use tonic::Status;

use crate::batcher::ProposeError;
use crate::raft::NodeId;
use crate::sm::CommandError;

pub use dtx_proto::metadata::FORWARDED_HEADER;
use dtx_proto::metadata::LEADER_ADDR_HEADER;
use dtx_proto::metadata::LEADER_ID_HEADER;
pub use dtx_proto::metadata::NOT_APPLIED_HEADER;

#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    /// This node is not the leader. `proposed` tells whether the command was
    /// handed to Raft before that was found out (then it may still apply).
    #[error("not the leader; leader is {leader_id:?} at {leader_api_addr:?}")]
    NotLeader {
        leader_id: Option<NodeId>,
        leader_api_addr: Option<String>,
        proposed: bool,
    },
    /// No leader is known; nothing was proposed.
    #[error("{0}")]
    NoLeader(String),
    #[error("{0}")]
    Unavailable(String),
    /// The outcome is not known: the command may or may not be applied.
    #[error("outcome unknown: {0}")]
    Unknown(String),
    #[error("{0}")]
    Internal(String),
}

impl From<CommandError> for ApiError {
    fn from(e: CommandError) -> Self {
        let m = e.to_string();
        match e {
            CommandError::NotFound { .. } => ApiError::NotFound(m),
            CommandError::KeyConflict { .. } => ApiError::AlreadyExists(m),
            CommandError::Invalid(_) => ApiError::InvalidArgument(m),
            CommandError::TooManyParticipants { .. } => ApiError::InvalidArgument(m),
            CommandError::NotActive { .. }
            | CommandError::ParticipantConflict { .. }
            | CommandError::VotersMismatch { .. }
            | CommandError::DeadlineNotReached { .. }
            | CommandError::NotDecided { .. }
            | CommandError::NotAllAcked { .. }
            | CommandError::UnknownParticipant { .. }
            | CommandError::OnePhaseOnly { .. }
            | CommandError::OperatorCommitNotPrepared { .. } => ApiError::FailedPrecondition(m),
        }
    }
}

impl From<ProposeError> for ApiError {
    fn from(e: ProposeError) -> Self {
        match e {
            ProposeError::NotLeader { leader_id, leader } => ApiError::NotLeader {
                leader_id,
                leader_api_addr: leader.map(|n| n.api_addr),
                proposed: true,
            },
            ProposeError::TooLarge { .. } => ApiError::InvalidArgument(e.to_string()),
            ProposeError::Overloaded(_) => ApiError::NoLeader(e.to_string()),
            ProposeError::Unavailable(_) => ApiError::Unavailable(e.to_string()),
        }
    }
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Status {
        let code = match &e {
            ApiError::InvalidArgument(_) => Code::InvalidArgument,
            ApiError::NotFound(_) => Code::NotFound,
            ApiError::AlreadyExists(_) => Code::AlreadyExists,
            ApiError::FailedPrecondition(_) => Code::FailedPrecondition,
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
        );
        if not_applied {
            status
                .metadata_mut()
                .insert(NOT_APPLIED_HEADER, MetadataValue::from_static("1"));
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
