//! The domain model: tasks (what users write), runs (what happened), and
//! schedule cursors. No transport types here.

pub mod backfill;
pub mod breaker;
pub mod budget;
pub mod event;
pub mod notification;
pub mod run;
pub mod task;
pub mod trace;
pub mod trigger;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

pub use run::{Attempt, Progress, RunRecord, RunStatus};
pub use task::{Definition, TaskRecord, TaskSpec};

/// Per-task scheduler state, stored under `schedule/{task_id}` and written
/// only by the leader.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Cursor {
    /// The last slot handled (fired, skipped or coalesced), UTC. Slots
    /// strictly after it are still to come.
    pub last_slot: Option<DateTime<Utc>>,
    /// When the cursor was written (UTC).
    pub updated_at: Option<DateTime<Utc>>,
    /// Runs its time slots have created (SKIPPED records not counted):
    /// what a trigger's `max_runs` bounds.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub time_runs: u64,
    /// The task's circuit breaker, once a run of a task with
    /// `execution.circuit_breaker` finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breaker: Option<breaker::Breaker>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}
