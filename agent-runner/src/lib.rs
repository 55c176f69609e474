//! punchclock agent runner: connects to the control plane, runs the agents it
//! is assigned as local processes, and reports their progress and outcome.
//!
//! * [`config`]: the agents file ([`AgentsFile`]) and [`RunnerConfig`].
//! * [`session`]: [`run`], the `RunnerService.Connect` session: handshake,
//!   assignments, fencing, reconnects, the outbox of `Finished` reports,
//!   shutdown.
//! * [`executor`]: runs one assignment as a process group and supervises it
//!   (files, environment, deadline, cancel, progress, result).
//! * [`shim`]: [`shim_main`], the tiny supervisor that keeps agents from
//!   outliving a killed runner or its fence (the `punchclock __agent-shim`
//!   subcommand).
//! * [`fence`]: the runner's self-fence deadline, shared with the shims.
//!
//! See `README.md` in this crate for the core flows.

#![warn(missing_docs)]

pub mod config;
mod error;
pub mod executor;
pub mod fence;
pub mod session;
pub mod shim;
mod time;

pub use config::{AgentSpec, AgentsFile, DEFAULT_KILL_GRACE, ProcessAgent, RunnerConfig};
pub use error::Error;
pub use executor::{Execution, ExecutionEvent, ExecutorSettings, StopRequest};
pub use session::run;
pub use shim::{SHIM_SUBCOMMAND, shim_main};
