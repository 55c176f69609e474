//! Per-task counts of the runs in memory, kept as runs change (the same
//! hooks the policies follow: a run remembered, touched, forgotten), so
//! admission and dispatch never walk a task's runs: a queue trigger may
//! leave a task 100,000 runs waiting, and every event's admission counted
//! them all (found by an attack: at 8,000 waiting, 36 ms an event, and the
//! engine too busy to answer its runners).
//!
//! For each task: the runs that hold one of its slots for admission (not
//! terminal, or terminal while their agent may be alive), less those
//! waiting out a delay (counted lazily: a run is delayed only while its
//! `next_attempt_at` is ahead of the clock); the runs waiting for dispatch
//! (PENDING or RETRYING, no open attempt); and the agents alive (an open
//! attempt, or one not yet confirmed gone).

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};

use super::policy::ActiveRun;
use crate::model::{RunRecord, RunStatus};

/// What one run counts as.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Flags {
    holder: bool,
    waiting: bool,
    live: bool,
    /// `next_attempt_at` of a PENDING run never dispatched: delayed while
    /// it is ahead of the clock.
    delay: Option<DateTime<Utc>>,
    scheduled_at: DateTime<Utc>,
    terminal: bool,
    /// A backfill made it.
    backfill: bool,
}

impl Flags {
    fn of(run: &RunRecord) -> Flags {
        let terminal = run.status.is_terminal();
        Flags {
            holder: if terminal { run.holds_agent() } else { true },
            waiting: matches!(run.status, RunStatus::Pending | RunStatus::Retrying) && run.current_attempt().is_none(),
            live: run.holds_agent(),
            delay: (run.status == RunStatus::Pending && run.attempts.is_empty()).then_some(run.next_attempt_at).flatten(),
            scheduled_at: run.scheduled_at,
            terminal,
            backfill: run.backfill_id.is_some(),
        }
    }
}

/// One task's counts.
#[derive(Debug, Default)]
struct TaskCounts {
    runs: HashMap<String, Flags>,
    holders: usize,
    waiting: usize,
    live: usize,
    /// Holders that may be delayed (few: delayed manual triggers, requeue pauses).
    delayed: HashSet<String>,
    /// Holders a backfill made.
    backfill: usize,
}

impl TaskCounts {
    fn add(&mut self, id: &str, f: Flags, sign: isize) {
        let apply = |n: &mut usize, on: bool| {
            if on {
                *n = n.saturating_add_signed(sign);
            }
        };
        apply(&mut self.holders, f.holder);
        apply(&mut self.waiting, f.waiting);
        apply(&mut self.live, f.live);
        apply(&mut self.backfill, f.holder && f.backfill);
        if f.holder && f.delay.is_some() {
            if sign > 0 {
                self.delayed.insert(id.to_string());
            } else {
                self.delayed.remove(id);
            }
        }
    }
}

/// Every task's counts.
#[derive(Debug, Default)]
pub(super) struct Counts {
    tasks: HashMap<String, TaskCounts>,
}

impl Counts {
    /// A run in memory changed (or was loaded or created).
    pub(super) fn update(&mut self, run: &RunRecord) {
        let f = Flags::of(run);
        let t = self.tasks.entry(run.task_id.clone()).or_default();
        if let Some(old) = t.runs.insert(run.run_id.clone(), f) {
            if old == f {
                return;
            }
            t.add(&run.run_id, old, -1);
        }
        t.add(&run.run_id, f, 1);
    }

    /// A run left memory.
    pub(super) fn remove(&mut self, run: &RunRecord) {
        let Some(t) = self.tasks.get_mut(&run.task_id) else { return };
        if let Some(old) = t.runs.remove(&run.run_id) {
            t.add(&run.run_id, old, -1);
        }
        if t.runs.is_empty() {
            self.tasks.remove(&run.task_id);
        }
    }

    /// Runs holding a slot of the task at `now`, not counting `except`
    /// (a `run_all` catch-up's own runs).
    pub(super) fn active(&self, task_id: &str, now: DateTime<Utc>, except: &HashSet<String>) -> usize {
        let Some(t) = self.tasks.get(task_id) else { return 0 };
        let delayed = t.delayed.iter().filter(|id| t.runs.get(*id).and_then(|f| f.delay).is_some_and(|d| d > now)).count();
        let excepted = except.iter().filter(|id| t.runs.get(*id).is_some_and(|f| f.holder && f.delay.is_none_or(|d| d <= now))).count();
        t.holders.saturating_sub(delayed).saturating_sub(excepted)
    }

    /// Runs a backfill made holding a slot of the task: a live slot's
    /// admission leaves them out (live slots keep their place).
    pub(super) fn backfill_holders(&self, task_id: &str) -> usize {
        self.tasks.get(task_id).map_or(0, |t| t.backfill)
    }

    /// Those runs (for `overlap_policy: cancel_running`, which picks the oldest).
    pub(super) fn active_runs(&self, task_id: &str, now: DateTime<Utc>, except: &HashSet<String>) -> Vec<ActiveRun> {
        let Some(t) = self.tasks.get(task_id) else { return Vec::new() };
        t.runs
            .iter()
            .filter(|(id, f)| f.holder && f.delay.is_none_or(|d| d <= now) && !except.contains(*id))
            .map(|(id, f)| ActiveRun { scheduled_at: f.scheduled_at, run_id: id.clone(), terminal: f.terminal })
            .collect()
    }

    /// Runs of the task waiting for dispatch (PENDING, RETRYING).
    pub(super) fn waiting(&self, task_id: &str) -> u64 {
        self.tasks.get(task_id).map_or(0, |t| t.waiting as u64)
    }

    /// Agents of the task alive or not confirmed gone.
    pub(super) fn live(&self, task_id: &str) -> usize {
        self.tasks.get(task_id).map_or(0, |t| t.live)
    }

    /// Checks every count against `runs` (tests).
    #[cfg(test)]
    pub(super) fn check(&self, runs: &HashMap<String, RunRecord>, now: DateTime<Utc>) {
        let mut by_task: HashMap<&str, Vec<&RunRecord>> = HashMap::new();
        for r in runs.values() {
            by_task.entry(r.task_id.as_str()).or_default().push(r);
        }
        for (task, rs) in &by_task {
            let active = rs.iter().filter(|r| if r.status.is_terminal() { r.holds_agent() } else { !r.is_delayed(now) }).count();
            let waiting =
                rs.iter().filter(|r| matches!(r.status, RunStatus::Pending | RunStatus::Retrying) && r.current_attempt().is_none()).count();
            let live = rs.iter().filter(|r| r.holds_agent()).count();
            assert_eq!(
                (self.active(task, now, &HashSet::new()), self.waiting(task) as usize, self.live(task)),
                (active, waiting, live),
                "counts of task {task} went stale"
            );
        }
        assert!(self.tasks.keys().all(|t| by_task.contains_key(t.as_str())), "counts of runs that left memory");
    }
}
