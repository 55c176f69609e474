//! punchclock agent runner: connects to the control plane, runs the agents it
//! is assigned as local processes, and reports their progress and outcome.
//!
//! * [`config`]: the agents file ([`AgentsFile`]) and [`RunnerConfig`].
//! * [`session`]: [`run`], the `RunnerService.Connect` session: handshake,
//!   assignments, fencing, reconnects, the outbox of `Finished` reports,
//!   shutdown.
//! * [`executor`]: runs one assignment as a process group and supervises it
//!   (files, environment, deadline, cancel, progress, result).
//! * [`shim`]: the `punchclock-agent-shim` crate, re-exported — the tiny
//!   supervisor that keeps agents from outliving a killed runner or its
//!   fence (its own binary, and the `punchclock __agent-shim` subcommand);
//!   [`ShimCommand`] says which one the runner execs.
//! * [`cgroup`]: CPU, memory and process limits of process agents (cgroup
//!   v2 or v1), and what an execution used.
//! * [`fence`]: the runner's self-fence deadline, shared with the shims.
//! * [`zygote`]: the runner's side of the shim's fork server, which forks
//!   each execution's supervisor instead of the runner exec'ing a shim.
//!
//! See `README.md` in this crate for the core flows.

#![warn(missing_docs)]

pub mod cgroup;
pub mod config;
mod error;
pub mod executor;
pub mod fence;
pub mod http_agent;
pub mod session;
mod time;
mod trace;
pub mod zygote;

pub use config::{AgentSpec, AgentsFile, Credentials, DEFAULT_AGENT_NICE, DEFAULT_KILL_GRACE, ProcessAgent, RunnerConfig, ShimCommand};
pub use error::Error;
pub use executor::{Execution, ExecutionEvent, ExecutorSettings, StopRequest};
pub use punchclock_agent_shim::{self as shim, SHIM_BINARY, SHIM_SUBCOMMAND, shim_main};
pub use session::run;
