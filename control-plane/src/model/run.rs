//! Runs: one record per due slot (or manual trigger), its attempts, and the
//! state machine of `DESIGN.md`:
//!
//! ```text
//! PENDING → RUNNING → SUCCEEDED | FAILED | TIMEOUT | CANCELLED
//! RUNNING → RETRYING → PENDING
//! SKIPPED (concurrency limit, misfire, paused) — always with a reason
//! ```

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// Run states; serialized as `PENDING`, `RUNNING`, ...
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RunStatus {
    /// Waiting for its time, a concurrency slot, or a runner.
    Pending,
    /// An attempt is executing on a runner.
    Running,
    /// Finished with exit code 0.
    Succeeded,
    /// The last attempt failed and no retry is left.
    Failed,
    /// An attempt failed; the next waits for its backoff.
    Retrying,
    /// The last attempt ran out of time.
    Timeout,
    /// Cancelled by a user or by `overlap_policy: cancel_running`.
    Cancelled,
    /// Never ran; `skip_reason` says why.
    Skipped,
}

impl RunStatus {
    /// Terminal states never change again.
    pub fn is_terminal(self) -> bool {
        matches!(self, RunStatus::Succeeded | RunStatus::Failed | RunStatus::Timeout | RunStatus::Cancelled | RunStatus::Skipped)
    }

    /// Upper-case name, as in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Pending => "PENDING",
            RunStatus::Running => "RUNNING",
            RunStatus::Succeeded => "SUCCEEDED",
            RunStatus::Failed => "FAILED",
            RunStatus::Retrying => "RETRYING",
            RunStatus::Timeout => "TIMEOUT",
            RunStatus::Cancelled => "CANCELLED",
            RunStatus::Skipped => "SKIPPED",
        }
    }

    /// Parses an upper- or lower-case name.
    pub fn parse(s: &str) -> Option<RunStatus> {
        serde_json::from_value(serde_json::Value::String(s.to_ascii_uppercase())).ok()
    }
}

/// Why a SKIPPED record exists.
pub mod skip_reason {
    /// `concurrency_limit` runs were active and `overlap_policy` is `skip`.
    pub const CONCURRENCY_LIMIT: &str = "concurrency_limit";
    /// Slots missed while no scheduler ran (coalesced).
    pub const MISFIRED: &str = "misfired";
    /// Slots due while the task was paused (coalesced).
    pub const PAUSED: &str = "paused";
}

/// Outcome names of an attempt.
pub mod outcome {
    /// Exit code 0.
    pub const SUCCEEDED: &str = "succeeded";
    /// Non-zero exit, or the agent could not start.
    pub const FAILED: &str = "failed";
    /// Killed at its deadline (or the runner never reported by then).
    pub const TIMEOUT: &str = "timeout";
    /// Cancelled.
    pub const CANCELLED: &str = "cancelled";
    /// Its runner was lost (silent too long, or the control plane restarted
    /// and nobody re-declared it).
    pub const LOST: &str = "lost";
}

/// One execution of a run on a runner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    /// 1-based.
    pub attempt: u32,
    /// Unique per attempt (UUID v4).
    pub execution_id: String,
    /// The runner it was assigned to.
    pub runner_id: String,
    /// That runner process's `Hello.instance_id` (empty if it sent none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub runner_instance: String,
    /// When it was assigned (UTC).
    pub dispatched_at: DateTime<Utc>,
    /// When the runner started the agent (UTC).
    #[serde(default)]
    pub started_at: Option<DateTime<Utc>>,
    /// When it ended (UTC).
    #[serde(default)]
    pub finished_at: Option<DateTime<Utc>>,
    /// See [`outcome`]; `None` while open.
    #[serde(default)]
    pub outcome: Option<String>,
    /// Why it failed.
    #[serde(default)]
    pub error: Option<String>,
    /// The agent's exit code, when it exited.
    #[serde(default)]
    pub exit_code: Option<i32>,
}

/// Latest progress report of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// 0..=100.
    pub percent: Option<f64>,
    /// Free text.
    pub message: String,
    /// Latest checkpoint (kept across attempts and given to the next one).
    pub checkpoint: Option<serde_json::Value>,
    /// When it arrived (UTC).
    pub updated_at: DateTime<Utc>,
}

/// A run record, stored under `runs/{run_id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// Deterministic per slot: see [`slot_run_id`].
    pub run_id: String,
    /// Owning task.
    pub task_id: String,
    /// Agent that runs it.
    pub agent_id: String,
    /// `cron`, `interval`, `once` or `manual`.
    pub trigger: String,
    /// Current state.
    pub status: RunStatus,
    /// Nominal slot time (UTC); for manual runs, the earliest start.
    pub scheduled_at: DateTime<Utc>,
    /// When the latest attempt was assigned to a runner (UTC).
    #[serde(default)]
    pub dispatched_at: Option<DateTime<Utc>>,
    /// When the first attempt actually started (UTC).
    #[serde(default)]
    pub actual_started_at: Option<DateTime<Utc>>,
    /// When it reached a terminal state (UTC).
    #[serde(default)]
    pub finished_at: Option<DateTime<Utc>>,
    /// Every attempt, oldest first.
    #[serde(default)]
    pub attempts: Vec<Attempt>,
    /// The agent's result JSON (from its result file).
    #[serde(default)]
    pub result: Option<serde_json::Value>,
    /// Latest progress.
    #[serde(default)]
    pub progress: Option<Progress>,
    /// For SKIPPED: see [`skip_reason`].
    #[serde(default)]
    pub skip_reason: Option<String>,
    /// For a coalesced SKIPPED record: how many slots.
    #[serde(default)]
    pub missed_count: Option<u64>,
    /// First slot covered (UTC).
    #[serde(default)]
    pub missed_from: Option<DateTime<Utc>>,
    /// Last slot covered (UTC).
    #[serde(default)]
    pub missed_until: Option<DateTime<Utc>>,
    /// Why a PENDING run is waiting.
    #[serde(default)]
    pub pending_reason: Option<String>,
    /// Earliest start of the next attempt (RETRYING, delayed PENDING).
    #[serde(default)]
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// Params given to the agent (task params merged with trigger params).
    #[serde(default)]
    pub params: serde_json::Map<String, serde_json::Value>,
    /// Last error (also in the attempt).
    #[serde(default)]
    pub error: Option<String>,
    /// Tail of the latest attempt's stdout.
    #[serde(default)]
    pub stdout_tail: String,
    /// Tail of the latest attempt's stderr.
    #[serde(default)]
    pub stderr_tail: String,
    /// Dispatch priority (copied from the task).
    #[serde(default)]
    pub priority: i32,
    /// Fencing token of the leader that last wrote the record.
    #[serde(default)]
    pub fencing_token: u64,
    /// Last write (UTC).
    pub updated_at: DateTime<Utc>,
}

impl RunRecord {
    /// A fresh PENDING run.
    pub fn pending(run_id: String, task_id: &str, agent_id: &str, trigger: &str, scheduled_at: DateTime<Utc>, now: DateTime<Utc>) -> Self {
        RunRecord {
            run_id,
            task_id: task_id.to_string(),
            agent_id: agent_id.to_string(),
            trigger: trigger.to_string(),
            status: RunStatus::Pending,
            scheduled_at,
            dispatched_at: None,
            actual_started_at: None,
            finished_at: None,
            attempts: Vec::new(),
            result: None,
            progress: None,
            skip_reason: None,
            missed_count: None,
            missed_from: None,
            missed_until: None,
            pending_reason: None,
            next_attempt_at: None,
            params: serde_json::Map::new(),
            error: None,
            stdout_tail: String::new(),
            stderr_tail: String::new(),
            priority: 0,
            fencing_token: 0,
            updated_at: now,
        }
    }

    /// A SKIPPED record covering `count` slots from `from` to `until`.
    #[allow(clippy::too_many_arguments)]
    pub fn skipped(
        run_id: String,
        task_id: &str,
        agent_id: &str,
        trigger: &str,
        reason: &str,
        (count, from, until): (u64, DateTime<Utc>, DateTime<Utc>),
        error: String,
        now: DateTime<Utc>,
    ) -> Self {
        let mut r = RunRecord::pending(run_id, task_id, agent_id, trigger, from, now);
        r.status = RunStatus::Skipped;
        r.skip_reason = Some(reason.to_string());
        r.missed_count = Some(count);
        r.missed_from = Some(from);
        r.missed_until = Some(until);
        r.finished_at = Some(now);
        r.error = Some(error);
        r
    }

    /// A PENDING run that may not start before a later instant (a delayed
    /// manual trigger) and has never been dispatched.
    pub fn is_delayed(&self, now: DateTime<Utc>) -> bool {
        self.status == RunStatus::Pending && self.attempts.is_empty() && self.next_attempt_at.is_some_and(|t| t > now)
    }

    /// The open (latest, unfinished) attempt.
    pub fn current_attempt_mut(&mut self) -> Option<&mut Attempt> {
        self.attempts.last_mut().filter(|a| a.outcome.is_none())
    }

    /// Execution id of the open attempt.
    pub fn current_execution(&self) -> Option<&str> {
        self.attempts.last().filter(|a| a.outcome.is_none()).map(|a| a.execution_id.as_str())
    }
}

/// Compact UTC stamp used in run ids: `20261130T003000Z`, with `.123` ms if any.
pub fn stamp(t: DateTime<Utc>) -> String {
    if t.timestamp_subsec_millis() == 0 { t.format("%Y%m%dT%H%M%SZ").to_string() } else { t.format("%Y%m%dT%H%M%S%.3fZ").to_string() }
}

/// Run id of a time-trigger slot: `{task_id}.{stamp}`. Task ids have no
/// dots, so `runs/{task_id}.` is an exact prefix of the task's runs.
pub fn slot_run_id(task_id: &str, slot: DateTime<Utc>) -> String {
    format!("{task_id}.{}", stamp(slot))
}

/// Run id of a manual trigger: `{task_id}.manual-{key}`.
pub fn manual_run_id(task_id: &str, key: &str) -> String {
    format!("{task_id}.manual-{key}")
}

/// The task id part of a run id.
pub fn task_of_run(run_id: &str) -> &str {
    run_id.split('.').next().unwrap_or(run_id)
}
