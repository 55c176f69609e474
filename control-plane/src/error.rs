//! The control plane's one error type.
//!
//! Every error has a stable machine-readable [`Error::code`] and a
//! [`Error::retryable`] hint; `service::status` is the one mapping to
//! `tonic::Status`.

/// Errors of the control plane core.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad input. `field` is the dotted path of the offending field in the
    /// task definition or request (e.g. `trigger.expr`, `execution.timeout_seconds`).
    #[error("{field}: {reason}")]
    InvalidArgument {
        /// Dotted path of the field.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The named task or run does not exist.
    #[error("{kind} {id:?} not found")]
    NotFound {
        /// `"task"` or `"run"`.
        kind: &'static str,
        /// The id looked up.
        id: String,
    },
    /// Something to create exists already (a run whose slot another writer took).
    #[error("{kind} {id:?} already exists")]
    AlreadyExists {
        /// `"run"`.
        kind: &'static str,
        /// Its id.
        id: String,
    },
    /// The request conflicts with the current state (e.g. cancelling a finished run).
    #[error("{0}")]
    FailedPrecondition(String),
    /// This replica cannot serve the request now (not the leader, store unreachable).
    /// `leader` is the leader's advertised address when known.
    #[error("unavailable: {reason}")]
    Unavailable {
        /// Why.
        reason: String,
        /// Advertised address of the current leader, if known.
        leader: Option<String>,
    },
    /// A leader write was rejected because another leader holds a newer
    /// fencing token (or the slot was already taken).
    #[error("fenced: {0}")]
    Fenced(String),
    /// The KV store failed.
    #[error("store: {0}")]
    Store(String),
    /// A bug or an unexpected state.
    #[error("internal: {0}")]
    Internal(String),
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidArgument { field: field.into(), reason: reason.into() }
    }

    /// Stable code: `invalid_argument`, `not_found`, `already_exists`, `failed_precondition`,
    /// `unavailable`, `fenced`, `store`, `internal`.
    pub fn code(&self) -> &'static str {
        match self {
            Error::InvalidArgument { .. } => "invalid_argument",
            Error::NotFound { .. } => "not_found",
            Error::AlreadyExists { .. } => "already_exists",
            Error::FailedPrecondition(_) => "failed_precondition",
            Error::Unavailable { .. } => "unavailable",
            Error::Fenced(_) => "fenced",
            Error::Store(_) => "store",
            Error::Internal(_) => "internal",
        }
    }

    /// Whether retrying the same request later may succeed.
    pub fn retryable(&self) -> bool {
        matches!(self, Error::Unavailable { .. } | Error::Store(_) | Error::Fenced(_))
    }
}

/// Result with the control plane's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
