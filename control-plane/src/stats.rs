//! Scheduling statistics computed from run records (`GetSchedulingStats`,
//! `punchclock stats`): per task, what fired and how it ended, what was
//! skipped and why, and the lag from each slot to its dispatch and to its
//! agent's start. Only stored records are read, so every replica gives the
//! same numbers for the same window.
//!
//! Definitions (README "Scheduling stats"):
//! - a record is in the window when its `scheduled_at` (for a coalesced
//!   SKIPPED record, its first slot) is in `[from, until]`;
//! - `fired`: records that are not SKIPPED (created to run);
//! - `succeeded`, `failed`, `timed_out`, `cancelled`: by final status;
//!   `in_progress`: PENDING, RUNNING or RETRYING;
//! - `retried`: runs with more than one attempt; `attempts`: all attempts;
//! - `skipped`: slots per `skip_reason` (a coalesced record counts its
//!   `missed_count`);
//! - dispatch lag: the first attempt's `dispatched_at - scheduled_at`;
//!   start lag: `actual_started_at - scheduled_at`; in milliseconds,
//!   negative values as 0; percentiles by the nearest-rank method
//!   (`p`-th percentile = the value at rank `ceil(p/100 * n)` of the sorted
//!   values).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::model::{RunRecord, RunStatus};

/// Lag figures of a set of runs, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lag {
    /// Runs measured.
    pub count: u64,
    /// Median (nearest rank).
    pub p50_ms: u64,
    /// 99th percentile (nearest rank).
    pub p99_ms: u64,
    /// Largest.
    pub max_ms: u64,
}

impl Lag {
    /// Figures of `values` (sorted here).
    pub fn of(mut values: Vec<u64>) -> Lag {
        values.sort_unstable();
        let n = values.len();
        if n == 0 {
            return Lag::default();
        }
        let rank = |p: u64| values[((p as usize * n).div_ceil(100)).clamp(1, n) - 1];
        Lag { count: n as u64, p50_ms: rank(50), p99_ms: rank(99), max_ms: values[n - 1] }
    }
}

/// The figures of one task (or of all, in the total).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskStats {
    /// Task (empty in the total).
    pub task_id: String,
    /// Records created to run (not SKIPPED).
    pub fired: u64,
    /// SUCCEEDED.
    pub succeeded: u64,
    /// FAILED.
    pub failed: u64,
    /// TIMEOUT.
    pub timed_out: u64,
    /// CANCELLED.
    pub cancelled: u64,
    /// PENDING, RUNNING or RETRYING.
    pub in_progress: u64,
    /// Runs with more than one attempt.
    pub retried: u64,
    /// Attempts of all runs.
    pub attempts: u64,
    /// Skipped slots per `skip_reason`.
    pub skipped: BTreeMap<String, u64>,
    /// `scheduled_at` → first dispatch.
    pub dispatch_lag: Lag,
    /// `scheduled_at` → agent started.
    pub start_lag: Lag,
}

/// Accumulates records of one task.
#[derive(Debug, Default)]
struct Acc {
    stats: TaskStats,
    dispatch: Vec<u64>,
    start: Vec<u64>,
}

impl Acc {
    fn add(&mut self, run: &RunRecord) {
        let s = &mut self.stats;
        if run.status == RunStatus::Skipped {
            let reason = run.skip_reason.map_or("unknown", |r| r.as_str()).to_string();
            *s.skipped.entry(reason).or_default() += run.missed_count.unwrap_or(1);
            return;
        }
        s.fired += 1;
        match run.status {
            RunStatus::Succeeded => s.succeeded += 1,
            RunStatus::Failed => s.failed += 1,
            RunStatus::Timeout => s.timed_out += 1,
            RunStatus::Cancelled => s.cancelled += 1,
            _ => s.in_progress += 1,
        }
        s.attempts += u64::from(run.attempt_count());
        if run.attempt_count() > 1 {
            s.retried += 1;
        }
        let ms = |t: DateTime<Utc>| u64::try_from((t - run.due_at()).num_milliseconds()).unwrap_or(0);
        if let Some(a) = run.attempts.first() {
            self.dispatch.push(ms(a.dispatched_at));
        }
        if let Some(t) = run.actual_started_at {
            self.start.push(ms(t));
        }
    }

    fn merge(&mut self, other: &Acc) {
        let (s, o) = (&mut self.stats, &other.stats);
        s.fired += o.fired;
        s.succeeded += o.succeeded;
        s.failed += o.failed;
        s.timed_out += o.timed_out;
        s.cancelled += o.cancelled;
        s.in_progress += o.in_progress;
        s.retried += o.retried;
        s.attempts += o.attempts;
        for (k, v) in &o.skipped {
            *s.skipped.entry(k.clone()).or_default() += v;
        }
        self.dispatch.extend_from_slice(&other.dispatch);
        self.start.extend_from_slice(&other.start);
    }

    fn finish(mut self) -> TaskStats {
        self.stats.dispatch_lag = Lag::of(self.dispatch);
        self.stats.start_lag = Lag::of(self.start);
        self.stats
    }
}

/// Stats of the records in a window, per task and in total.
#[derive(Debug)]
pub struct Collector {
    from: DateTime<Utc>,
    until: DateTime<Utc>,
    tasks: BTreeMap<String, Acc>,
}

/// What [`Collector::finish`] returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulingStats {
    /// Window start (UTC, inclusive).
    pub from: DateTime<Utc>,
    /// Window end (UTC, inclusive).
    pub until: DateTime<Utc>,
    /// Per task with a record in the window, by task id.
    pub tasks: Vec<TaskStats>,
    /// All of them together (`task_id` empty).
    pub total: TaskStats,
}

impl Collector {
    /// Counts records whose slot is in `[from, until]` (UTC).
    pub fn new(from: DateTime<Utc>, until: DateTime<Utc>) -> Self {
        Collector { from, until, tasks: BTreeMap::new() }
    }

    /// Adds one record (ignored when outside the window).
    pub fn add(&mut self, run: &RunRecord) {
        if run.scheduled_at < self.from || run.scheduled_at > self.until {
            return;
        }
        self.tasks.entry(run.task_id.clone()).or_default().add(run);
    }

    /// The figures.
    pub fn finish(self) -> SchedulingStats {
        let mut total = Acc::default();
        let mut tasks = Vec::with_capacity(self.tasks.len());
        for (id, acc) in self.tasks {
            total.merge(&acc);
            let mut s = acc.finish();
            s.task_id = id;
            tasks.push(s);
        }
        SchedulingStats { from: self.from, until: self.until, tasks, total: total.finish() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Attempt;
    use crate::model::run::{SkipReason, TriggerKind};

    #[test]
    fn nearest_rank_percentiles() {
        assert_eq!(Lag::of(vec![]), Lag::default());
        assert_eq!(Lag::of(vec![7]), Lag { count: 1, p50_ms: 7, p99_ms: 7, max_ms: 7 });
        let l = Lag::of((1..=100).rev().collect());
        assert_eq!((l.p50_ms, l.p99_ms, l.max_ms), (50, 99, 100));
        let l = Lag::of((1..=201).collect());
        assert_eq!((l.p50_ms, l.p99_ms), (101, 199));
    }

    #[test]
    fn counts_runs_skips_and_lags_inside_the_window() {
        let t = |s: i64| DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap();
        let mut c = Collector::new(t(0), t(100));
        let mut ok = RunRecord::pending("a.1".into(), "a", "ag", TriggerKind::Cron, t(10), t(10));
        ok.status = RunStatus::Succeeded;
        let att: Attempt = serde_json::from_value(serde_json::json!({
            "attempt": 1, "execution_id": "e", "runner_id": "r",
            "dispatched_at": t(10) + chrono::Duration::milliseconds(40)}))
        .unwrap();
        ok.attempts = vec![att.clone(), att];
        ok.actual_started_at = Some(t(10) + chrono::Duration::milliseconds(90));
        c.add(&ok);
        let mut failed = RunRecord::pending("a.2".into(), "a", "ag", TriggerKind::Cron, t(20), t(20));
        failed.status = RunStatus::Failed;
        c.add(&failed);
        let skip =
            RunRecord::skipped("b.1".into(), "b", "ag", TriggerKind::Cron, SkipReason::Misfired, (5, t(30), t(34)), "x".into(), t(40));
        c.add(&skip);
        let outside = RunRecord::pending("a.3".into(), "a", "ag", TriggerKind::Cron, t(101), t(101));
        c.add(&outside);
        let s = c.finish();
        assert_eq!(s.tasks.len(), 2);
        let a = &s.tasks[0];
        assert_eq!((a.fired, a.succeeded, a.failed, a.retried, a.attempts), (2, 1, 1, 1, 2));
        assert_eq!(a.dispatch_lag, Lag { count: 1, p50_ms: 40, p99_ms: 40, max_ms: 40 });
        assert_eq!(a.start_lag.max_ms, 90);
        assert_eq!(s.tasks[1].skipped.get("misfired"), Some(&5));
        assert_eq!((s.total.fired, s.total.skipped.get("misfired")), (2, Some(&5)));
    }
}
