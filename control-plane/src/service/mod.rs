//! Thin gRPC handlers: convert the request, call [`crate::api::Core`], map
//! the error. The one mapping from [`Error`] to `tonic::Status` lives here.

mod cluster;
pub mod convert;
mod notification;
mod run;
mod runner;
mod task;

pub use cluster::ClusterSvc;
pub use notification::NotificationSvc;
pub use run::RunSvc;
pub use runner::RunnerSvc;
pub use task::TaskSvc;

use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

use crate::error::Error;

/// Metadata key carrying the leader's advertised address on `UNAVAILABLE`.
pub const LEADER_METADATA: &str = "punchclock-leader";
/// Metadata key carrying [`Error::code`].
pub const CODE_METADATA: &str = "punchclock-code";

/// Maps a core error to a gRPC status: `InvalidArgument` names the field;
/// `Unavailable` carries the leader's address in `punchclock-leader`.
pub fn status(e: Error) -> Status {
    let code = match &e {
        Error::InvalidArgument { .. } => Code::InvalidArgument,
        Error::NotFound { .. } => Code::NotFound,
        Error::AlreadyExists { .. } => Code::AlreadyExists,
        Error::FailedPrecondition(_) => Code::FailedPrecondition,
        Error::Unavailable { .. } | Error::Fenced(_) | Error::Store(_) => Code::Unavailable,
        Error::Internal(_) => Code::Internal,
    };
    let mut s = Status::new(code, e.to_string());
    if let Ok(v) = MetadataValue::try_from(e.code()) {
        s.metadata_mut().insert(CODE_METADATA, v);
    }
    if let Error::Unavailable { leader: Some(l), .. } = &e
        && let Ok(v) = MetadataValue::try_from(l.as_str())
    {
        s.metadata_mut().insert(LEADER_METADATA, v);
    }
    if !matches!(e, Error::InvalidArgument { .. } | Error::NotFound { .. }) {
        tracing::warn!(code = e.code(), error = %e, "request failed");
    }
    s
}
