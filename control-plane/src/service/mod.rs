//! Thin gRPC handlers: convert the request, call [`crate::api::Core`], map
//! the error. The one mapping from [`Error`] to `tonic::Status` lives here.

mod cluster;
mod config;
pub mod convert;
pub mod definition;
mod notification;
mod run;
mod runner;
mod task;

pub use cluster::ClusterSvc;
pub use config::ConfigSvc;
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

/// Longest status message: the message travels in a header
/// (`grpc-message`, percent-encoded) and a client refuses header blocks
/// over its limit (16 KiB by default) — a 1 MB task id echoed in an error
/// made the whole answer unreadable (issue 19). Longer messages are cut,
/// saying how much was left out.
pub const MAX_STATUS_MESSAGE_BYTES: usize = 4096;

/// `text` cut to at most `max` bytes (at a character boundary), with the
/// number of bytes left out.
pub fn truncate_message(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max.saturating_sub(40);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{} ... [{} more bytes]", &text[..end], text.len() - end)
}

/// Maps a core error to a gRPC status: `InvalidArgument` names the field;
/// `Unavailable` carries the leader's address in `punchclock-leader`; the
/// message is at most [`MAX_STATUS_MESSAGE_BYTES`].
pub fn status(e: Error) -> Status {
    let code = match &e {
        Error::InvalidArgument { .. } => Code::InvalidArgument,
        Error::NotFound { .. } => Code::NotFound,
        Error::AlreadyExists { .. } => Code::AlreadyExists,
        Error::FailedPrecondition(_) => Code::FailedPrecondition,
        Error::Unavailable { .. } | Error::Fenced(_) | Error::Store(_) => Code::Unavailable,
        Error::Internal(_) => Code::Internal,
    };
    let message = truncate_message(&e.to_string(), MAX_STATUS_MESSAGE_BYTES);
    let mut s = Status::new(code, message.clone());
    if let Ok(v) = MetadataValue::try_from(e.code()) {
        s.metadata_mut().insert(CODE_METADATA, v);
    }
    if let Error::Unavailable { leader: Some(l), .. } = &e
        && let Ok(v) = MetadataValue::try_from(l.as_str())
    {
        s.metadata_mut().insert(LEADER_METADATA, v);
    }
    if !matches!(e, Error::InvalidArgument { .. } | Error::NotFound { .. }) {
        tracing::warn!(code = e.code(), error = %message, "request failed");
    }
    s
}
