//! Backfills: a task's own slots over a past range, run again or for the
//! first time (`punchclock task backfill`). A backfill is a durable
//! object (`backfills/{id}`) whose cursor — the last slot it handled —
//! the fenced leader advances in the same transaction as the run it
//! creates for that slot (Temporal's backfiller keeps such a watermark:
//! chasm/lib/scheduler/backfiller_tasks.go), so a failover or restart
//! goes on from it and never creates a slot twice.
//!
//! Its runs are the task's slots with the live slots' run ids
//! (`{task}.{stamp}`), so a backfill never duplicates a live or an earlier
//! run: `missing` fills slots with no record; `failed` re-runs only slots whose
//! run ended FAILED or TIMEOUT as a linked run `{slot run}.rerun-1` (a new
//! run, not a new attempt: the first run's record, attempts and result
//! stay as they were, the audit trail intact, and the link says which
//! slot it re-runs); `all` does both for every slot. What each slot gets
//! is [`decide`], shared by the dry run and the real one.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::run::{RunRecord, RunStatus};
use crate::error::{Error, Result};

/// Most slots one backfill plans.
pub const MAX_BACKFILL_SLOTS: usize = 10_000;

/// Most runs a backfill has live at once.
pub const MAX_BACKFILL_CONCURRENT: u32 = 1_000;

/// What a backfill runs again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Reprocess {
    /// Slots with no record.
    #[default]
    Missing,
    /// Slots whose run ended FAILED or TIMEOUT (a linked run each).
    Failed,
    /// Every slot: a run where none is, a linked run where one is.
    All,
}

/// Which end of the range first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Order {
    /// From `from` forward.
    #[default]
    Oldest,
    /// From `to` backward.
    Newest,
}

/// What a failed backfill run does to the backfill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnFailure {
    /// Go on.
    #[default]
    Continue,
    /// Stop creating runs (state `stopped`).
    Stop,
}

/// Where a backfill stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackfillState {
    /// Creating runs as room allows.
    Running,
    /// Its cursor frozen until resumed.
    Paused,
    /// Stopped by hand; its record kept.
    Cancelled,
    /// A run failed under `on_failure: stop`.
    Stopped,
    /// Every slot handled and every run it made ended.
    Done,
}

impl BackfillState {
    /// As stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            BackfillState::Running => "running",
            BackfillState::Paused => "paused",
            BackfillState::Cancelled => "cancelled",
            BackfillState::Stopped => "stopped",
            BackfillState::Done => "done",
        }
    }
}

/// What a user asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackfillSpec {
    /// The task whose slots are run.
    pub task_id: String,
    /// Slots from (inclusive).
    pub from: DateTime<Utc>,
    /// Slots until (inclusive); at most now.
    pub to: DateTime<Utc>,
    /// What is run again.
    #[serde(default)]
    pub reprocess: Reprocess,
    /// Its runs live at once, at most (1..=1000).
    pub max_concurrent: u32,
    /// Which end first.
    #[serde(default)]
    pub order: Order,
    /// What a failed run does.
    #[serde(default)]
    pub on_failure: OnFailure,
}

impl BackfillSpec {
    /// Its problems, by field.
    ///
    /// Errors: `InvalidArgument` naming `task_id`, `from` (before 1970),
    /// `to` (before `from`, or in the future), `max_concurrent`.
    pub fn validate(&self, now: DateTime<Utc>) -> Result<()> {
        super::task::validate_id("task_id", &self.task_id)?;
        if self.from < DateTime::<Utc>::UNIX_EPOCH {
            return Err(Error::invalid("from", format!("{} is before 1970-01-01T00:00:00Z", self.from)));
        }
        if self.to < self.from {
            return Err(Error::invalid("to", format!("{} is before from {}", self.to, self.from)));
        }
        if self.to > now {
            return Err(Error::invalid("to", "is in the future: the task's own schedule runs those slots"));
        }
        if self.max_concurrent == 0 || self.max_concurrent > MAX_BACKFILL_CONCURRENT {
            return Err(Error::invalid("max_concurrent", format!("1 to {MAX_BACKFILL_CONCURRENT}")));
        }
        Ok(())
    }
}

/// A backfill as stored: its spec, state, cursor and counters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Backfill {
    /// `bf-{task}-{ms}`.
    pub id: String,
    /// What was asked.
    pub spec: BackfillSpec,
    /// Where it stands.
    pub state: BackfillState,
    /// The last slot handled (in `spec.order`); none yet: `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<DateTime<Utc>>,
    /// Slots in the range.
    pub planned: u64,
    /// Runs it created (linked runs included).
    pub created: u64,
    /// Slots left alone (a record there already, a re-run already, a DST gap).
    pub left: u64,
    /// Its runs that ended SUCCEEDED.
    pub succeeded: u64,
    /// Its runs that ended FAILED or TIMEOUT.
    pub failed: u64,
    /// Its runs that ended otherwise (SKIPPED by a policy, CANCELLED).
    pub other: u64,
    /// Its runs not ended yet.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub in_flight: Vec<String>,
    /// Why it stopped, when it did.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// When it was asked for.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
}

impl Backfill {
    /// A new backfill `id` of `spec`, running, of `planned` slots, asked for at `now`.
    pub fn start(id: String, spec: BackfillSpec, planned: u64, now: DateTime<Utc>) -> Backfill {
        Backfill {
            id,
            spec,
            state: BackfillState::Running,
            cursor: None,
            planned,
            created: 0,
            left: 0,
            succeeded: 0,
            failed: 0,
            other: 0,
            in_flight: Vec::new(),
            reason: String::new(),
            created_at: now,
            updated_at: now,
        }
    }

    /// Slots not handled yet.
    pub fn remaining(&self) -> u64 {
        self.planned.saturating_sub(self.created + self.left)
    }

    /// Whether it creates no more runs.
    pub fn finished(&self) -> bool {
        matches!(self.state, BackfillState::Cancelled | BackfillState::Stopped | BackfillState::Done)
    }
}

/// What a slot of a backfill gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Its run, `{task}.{stamp}` (no record there).
    Run,
    /// A linked run `{slot run}.rerun-1` (re-running what is there).
    Rerun,
    /// Nothing: why, in words (`exists: SUCCEEDED`, `re-run exists`, `dst_gap`).
    Leave(String),
}

impl Verdict {
    /// As a dry run lists it: `would_run`, `would_rerun`, or the reason.
    pub fn words(&self) -> String {
        match self {
            Verdict::Run => "would_run".into(),
            Verdict::Rerun => "would_rerun".into(),
            Verdict::Leave(why) => why.clone(),
        }
    }
}

/// What `reprocess` does with a slot whose record is `slot_run` (none:
/// no record), when the slot's linked re-run exists or not
/// (`rerun_exists`). A run still going is left alone.
pub fn decide(reprocess: Reprocess, slot_run: Option<&RunRecord>, rerun_exists: bool) -> Verdict {
    let Some(run) = slot_run else {
        return match reprocess {
            Reprocess::Failed => Verdict::Leave("no record (reprocess: failed runs only failed slots)".into()),
            Reprocess::Missing | Reprocess::All => Verdict::Run,
        };
    };
    let status = run.status.as_str();
    if !run.status.is_terminal() {
        return Verdict::Leave(format!("exists: {status}"));
    }
    let failed = matches!(run.status, RunStatus::Failed | RunStatus::Timeout);
    match reprocess {
        Reprocess::Missing => Verdict::Leave(format!("exists: {status}")),
        Reprocess::Failed if !failed => Verdict::Leave(format!("exists: {status}")),
        Reprocess::Failed | Reprocess::All if rerun_exists => Verdict::Leave(format!("exists: {status}, re-run exists")),
        Reprocess::Failed | Reprocess::All => Verdict::Rerun,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::run::TriggerKind;

    fn run(status: RunStatus) -> RunRecord {
        let t: DateTime<Utc> = "2026-12-01T00:00:00Z".parse().expect("t");
        let mut r = RunRecord::pending("t.x".into(), "t", "a", TriggerKind::Cron, t, t);
        r.status = status;
        r
    }

    #[test]
    fn each_reprocess_decides_as_documented() {
        let (ok, failed, timeout, pending) =
            (run(RunStatus::Succeeded), run(RunStatus::Failed), run(RunStatus::Timeout), run(RunStatus::Pending));
        assert_eq!(decide(Reprocess::Missing, None, false), Verdict::Run);
        assert_eq!(decide(Reprocess::Missing, Some(&failed), false), Verdict::Leave("exists: FAILED".into()));
        assert_eq!(decide(Reprocess::Failed, Some(&failed), false), Verdict::Rerun);
        assert_eq!(decide(Reprocess::Failed, Some(&timeout), false), Verdict::Rerun);
        assert_eq!(decide(Reprocess::Failed, Some(&failed), true), Verdict::Leave("exists: FAILED, re-run exists".into()));
        assert_eq!(decide(Reprocess::Failed, Some(&ok), false), Verdict::Leave("exists: SUCCEEDED".into()));
        assert!(matches!(decide(Reprocess::Failed, None, false), Verdict::Leave(_)), "failed runs only failed slots");
        assert_eq!(decide(Reprocess::All, None, false), Verdict::Run);
        assert_eq!(decide(Reprocess::All, Some(&ok), false), Verdict::Rerun);
        assert_eq!(decide(Reprocess::All, Some(&pending), false), Verdict::Leave("exists: PENDING".into()));
    }
}
