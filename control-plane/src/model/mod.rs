//! The domain model: tasks (what users write), runs (what happened), and
//! schedule cursors. No transport types here.

pub mod run;
pub mod task;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

pub use run::{Attempt, Progress, RunRecord, RunStatus};
pub use task::{TaskRecord, TaskSpec};

/// Per-task scheduler state, stored under `schedule/{task_id}` and written
/// only by the leader.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Cursor {
    /// The last slot handled (fired, skipped or coalesced), UTC. Slots
    /// strictly after it are still to come.
    pub last_slot: Option<DateTime<Utc>>,
    /// When the cursor was written (UTC).
    pub updated_at: Option<DateTime<Utc>>,
}
