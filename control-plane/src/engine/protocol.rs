//! The runner protocol as the engine sees it: what runners tell the leader
//! ([`FromRunner`], [`RunnerHello`]) and what the leader tells them
//! ([`ToRunner`]). `service/runner.rs` converts these to and from
//! `punchclock.v1`; nothing under `engine/` names a wire type.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

/// An execution a runner says it holds (`Hello.in_flight`, `Welcome.unknown`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InFlightExec {
    /// Run.
    pub run_id: String,
    /// Execution (attempt) id.
    pub execution_id: String,
    /// Attempt number as the runner knows it (0 = unknown).
    pub attempt: u32,
    /// When its agent started (UTC), if the runner says.
    pub started_at: Option<DateTime<Utc>>,
}

/// A runner's first message on a new stream.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RunnerHello {
    /// Runner id (non-empty).
    pub runner_id: String,
    /// Agent ids it serves.
    pub agents: Vec<String>,
    /// Concurrent executions it accepts.
    pub slots: u32,
    /// Labels for selectors.
    pub labels: BTreeMap<String, String>,
    /// Its version string.
    pub version: String,
    /// Executions it is running, or finished and not yet acknowledged.
    pub in_flight: Vec<InFlightExec>,
    /// Random per runner process: tells a reconnect of the same process
    /// from a restarted runner with the same id (empty = unknown).
    pub instance_id: String,
}

/// How an execution ended, as its runner reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportedOutcome {
    /// Exit code 0.
    Succeeded,
    /// Non-zero exit or could not wait for the agent.
    Failed,
    /// Killed at its deadline.
    Timeout,
    /// Stopped by a `Cancel`.
    Cancelled,
    /// Not started (no free slot, unknown agent, shutting down, spawn
    /// failure): no attempt ran.
    Refused,
    /// Stopped because the runner shut down or lost the leader.
    Interrupted,
}

/// A runner's `Finished`.
#[derive(Debug, Clone, PartialEq)]
pub struct FinishedReport {
    /// Run.
    pub run_id: String,
    /// Execution.
    pub execution_id: String,
    /// Outcome.
    pub outcome: ReportedOutcome,
    /// The agent's result (already parsed; a non-JSON result is a string).
    pub result: Option<serde_json::Value>,
    /// Error text (empty = none).
    pub error: String,
    /// Exit code of the agent process.
    pub exit_code: Option<i32>,
    /// Last bytes of stdout.
    pub stdout_tail: String,
    /// Last bytes of stderr.
    pub stderr_tail: String,
    /// When the agent started (UTC), if the runner says.
    pub started_at: Option<DateTime<Utc>>,
    /// When it ended (UTC), if the runner says.
    pub finished_at: Option<DateTime<Utc>>,
    /// The runner's class of the end ("oom_killed"), used when the agent's
    /// result names none.
    pub class: Option<String>,
    /// What the execution used, from its cgroup.
    pub machine: Option<crate::model::run::MachineUse>,
}

/// A message from a runner after its Hello.
#[derive(Debug, Clone, PartialEq)]
pub enum FromRunner {
    /// Liveness; answered with [`ToRunner::HeartbeatAck`] carrying `seq`.
    Heartbeat {
        /// Echoed in the ack.
        seq: u64,
        /// The runner is shutting down: no new assignment for it.
        draining: bool,
        /// The highest ack seq the runner received on this stream.
        acked_seq: u64,
    },
    /// The agent process started.
    Started {
        /// Run.
        run_id: String,
        /// Execution.
        execution_id: String,
        /// When (UTC), if the runner says.
        started_at: Option<DateTime<Utc>>,
    },
    /// The agent wrote a progress line.
    Progress {
        /// Run.
        run_id: String,
        /// Execution.
        execution_id: String,
        /// 0..=100.
        percent: Option<f64>,
        /// Free text.
        message: String,
        /// New checkpoint, if the line carried one.
        checkpoint: Option<serde_json::Value>,
    },
    /// The execution ended (or was refused).
    Finished(Box<FinishedReport>),
}

/// What an `Assign` carries.
#[derive(Debug, Clone, PartialEq)]
pub struct Assignment {
    /// Run.
    pub run_id: String,
    /// New execution id.
    pub execution_id: String,
    /// 1-based attempt number.
    pub attempt: u32,
    /// Task.
    pub task_id: String,
    /// Agent.
    pub agent_id: String,
    /// The run's context document (JSON text), given to the agent on stdin.
    pub context_json: String,
    /// The latest checkpoint (JSON text, empty = none).
    pub checkpoint_json: String,
    /// The runner kills the agent at this instant (UTC).
    pub deadline: DateTime<Utc>,
    /// The timeout it came from, in seconds.
    pub timeout_seconds: u64,
    /// The leader's fencing token.
    pub fencing_token: u64,
    /// The run's slot (UTC).
    pub scheduled_at: DateTime<Utc>,
    /// The run's trace (32 hex digits; empty when it has none).
    pub trace_id: String,
    /// The attempt's span (16 hex digits): the runner's `invoke_agent`
    /// span is its child (sent as `Assign.traceparent`).
    pub span_id: String,
    /// The caller's W3C `tracestate` (empty = none).
    pub trace_state: String,
    /// The caller's W3C `baggage` (empty = none).
    pub baggage: String,
    /// The run's event body is stored beside it (`events/{run_id}`): the
    /// shell reads it and puts it in `context_json`'s `event.body` before
    /// sending (never sent as such).
    pub stored_event_body: bool,
    /// The task's `execution.limits`, if any.
    pub limits: Option<crate::model::task::LimitsSpec>,
}

/// A message from the leader to one runner.
#[derive(Debug, Clone, PartialEq)]
pub enum ToRunner {
    /// The answer to Hello.
    Welcome {
        /// The leader's fencing token.
        fencing_token: u64,
        /// How often the runner heartbeats, in milliseconds.
        heartbeat_interval_ms: u32,
        /// The leader's replica id.
        leader_id: String,
        /// In-flight executions of the Hello the leader does not know, has
        /// ended, or that belong to another runner: the runner stops them.
        unknown: Vec<InFlightExec>,
        /// Runner self-fence deadline in milliseconds (see `timing.rs`).
        fence_ms: u64,
        /// How long before the deadline, beyond its kill grace, the runner
        /// starts stopping its agents ([`crate::timing::RUNNER_STOP_LEAD`]).
        stop_lead_ms: u64,
    },
    /// Start an execution.
    Assign(Box<Assignment>),
    /// Stop an execution (TERM, kill grace, KILL) and report it.
    Cancel {
        /// Run.
        run_id: String,
        /// Execution.
        execution_id: String,
        /// Why (shown in the runner's log and the report).
        reason: String,
    },
    /// The `Finished` of this execution is stored: the runner may forget it.
    FinishedAck {
        /// Run.
        run_id: String,
        /// Execution.
        execution_id: String,
    },
    /// The answer to a heartbeat.
    HeartbeatAck {
        /// The leader's fencing token.
        fencing_token: u64,
        /// The heartbeat's seq.
        seq: u64,
    },
}
