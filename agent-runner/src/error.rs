//! The crate's error type.

use std::io;
use std::path::PathBuf;

/// Everything that can go wrong in the agent runner.
///
/// Configuration errors ([`Error::ReadAgentsFile`], [`Error::InvalidAgentsFile`],
/// [`Error::InvalidConfig`]) are fatal and returned to the caller. The others
/// describe one failed attempt (one connection, one execution): the session
/// logs them and carries on (reconnects, or reports the execution as failed).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The agents file could not be read.
    #[error("cannot read agents file {}: {source}", path.display())]
    ReadAgentsFile {
        /// The file that was read.
        path: PathBuf,
        /// The underlying I/O error.
        source: io::Error,
    },

    /// The agents file is not valid; `message` names the offending field,
    /// e.g. `agents.report_agent.command: must not be empty`.
    #[error("invalid agents file {}: {message}", path.display())]
    InvalidAgentsFile {
        /// The file that was parsed.
        path: PathBuf,
        /// What is wrong, prefixed with the field's path.
        message: String,
    },

    /// The runner configuration is unusable (no control-plane address, zero
    /// slots, ...).
    #[error("invalid runner configuration: {0}")]
    InvalidConfig(String),

    /// Another live runner process holds this work directory's lock: two
    /// processes with one `--runner-id` on one host would take each other's
    /// runs and delete each other's execution directories.
    #[error("work directory {} is in use by another runner process (same --runner-id on this host?); waited 30 s for it to exit", path.display())]
    WorkDirInUse {
        /// The work directory.
        path: PathBuf,
    },

    /// The per-execution directory (or a file in it) could not be created.
    #[error("cannot prepare execution directory {}: {source}", path.display())]
    ExecutionDir {
        /// The directory or file that could not be written.
        path: PathBuf,
        /// The underlying I/O error.
        source: io::Error,
    },

    /// The agent process (or the shim in front of it) could not be spawned.
    #[error("cannot start agent {agent_id} ({program}): {source}")]
    Spawn {
        /// The agent id from the assignment.
        agent_id: String,
        /// The program that was executed (the agent's `command[0]`, or the shim).
        program: String,
        /// The underlying I/O error.
        source: io::Error,
    },

    /// A control-plane address is not a valid URI.
    #[error("invalid control-plane address {address}: {source}")]
    InvalidAddress {
        /// The address as configured or received in a `Reject`.
        address: String,
        /// Why tonic refused it.
        source: tonic::transport::Error,
    },

    /// The control plane could not be reached.
    #[error("cannot connect to control plane {address}: {source}")]
    Connect {
        /// The address that was dialled.
        address: String,
        /// The transport error.
        source: tonic::transport::Error,
    },

    /// The control plane refused or broke the `RunnerService.Connect` stream.
    #[error("control plane {address} failed the runner stream: {status}")]
    Stream {
        /// The control plane's address.
        address: String,
        /// The gRPC status (boxed: `tonic::Status` is large).
        status: Box<tonic::Status>,
    },

    /// The control plane broke the runner protocol (e.g. no `Welcome` first).
    #[error("protocol error from control plane {address}: {message}")]
    Protocol {
        /// The control plane's address.
        address: String,
        /// What was expected and what arrived.
        message: String,
    },
}
