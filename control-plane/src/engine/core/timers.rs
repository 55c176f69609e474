//! The core's timers: slots and caller-named delays on the wall clock
//! (a slot, a `not_before` is a time of day); backoffs, checks, releases
//! and flushes on elapsed time ([`Mono`]); and two kinds of deadline kept
//! as [`Deadlines`] (one entry per run or attempt, moved or dropped as it
//! changes, never piling up): a waiting run's start deadline and an open
//! attempt's backstop.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use chrono::{DateTime, Utc};

use super::deadlines::Deadlines;
use crate::clock::{Mono, Now};

/// What a timer does when it fires.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Timer {
    /// Handle the due slots of a task (if `generation` is still current).
    Fire { task_id: String, generation: u64 },
    /// A delayed, retrying or requeued run may be dispatched, if it still
    /// waits for `at` (its `next_attempt_at`).
    RunDue { run_id: String, at: DateTime<Utc> },
    /// An attempt whose old runner process may still be alive stops
    /// holding its concurrency slot (that process's fence has passed).
    ReleaseOrphan { run_id: String, execution_id: String },
    /// Check for silent and lost runners.
    RunnerCheck,
    /// Write the lazily persisted changes (progress).
    Flush,
    /// A policy's wait ends (a hold-back, a rate window refills): look at
    /// the ready runs again.
    Wake,
    /// An open attempt's backstop deadline passed.
    Deadline { run_id: String, execution_id: String },
    /// A waiting run's start deadline passed.
    StartBy { run_id: String },
    /// A backfill waits for its task's own schedule to pass a slot.
    BackfillStep { id: String },
}

/// See the module docs.
#[derive(Debug, Default)]
pub(super) struct Timers {
    wall: BinaryHeap<Reverse<(DateTime<Utc>, u64, Timer)>>,
    mono: BinaryHeap<Reverse<(Mono, u64, Timer)>>,
    seq: u64,
    /// Start deadlines of runs waiting for dispatch (`start_timeout_seconds`).
    pub start_by: Deadlines<String>,
    /// The control plane's backstop deadline of each open attempt: `(run, execution)`.
    pub attempt_deadlines: Deadlines<(String, String)>,
    /// A runner check is armed.
    pub runner_check_armed: bool,
    /// A flush is armed.
    pub flush_armed: bool,
    /// The earliest armed wake (one is enough until it fires).
    wake_at: Option<Mono>,
    /// The last timer taken while both heaps had one due came from the
    /// wall clock heap: the next such pick is the monotonic heap's.
    took_wall: bool,
}

impl Timers {
    /// A timer for when the wall clock reads `at`.
    pub(super) fn push_wall(&mut self, at: DateTime<Utc>, t: Timer) {
        self.seq += 1;
        self.wall.push(Reverse((at, self.seq, t)));
    }

    /// The armed fires: `(when, task, generation)`, stale ones included.
    pub(super) fn fires(&self) -> impl Iterator<Item = (DateTime<Utc>, &str, u64)> {
        self.wall.iter().filter_map(|Reverse((at, _, t))| match t {
            Timer::Fire { task_id, generation } => Some((*at, task_id.as_str(), *generation)),
            _ => None,
        })
    }

    /// A timer for when the monotonic clock reaches `at`.
    pub(super) fn push_mono(&mut self, at: Mono, t: Timer) {
        self.seq += 1;
        self.mono.push(Reverse((at, self.seq, t)));
    }

    /// A [`Timer::Wake`] at `at`, unless one is armed at or before it.
    pub(super) fn wake_at(&mut self, at: Mono) {
        if self.wake_at.is_some_and(|w| w <= at) {
            return;
        }
        self.wake_at = Some(at);
        self.push_mono(at, Timer::Wake);
    }

    /// When the next timer is due, on the monotonic clock (wall clock
    /// timers converted with the reading `now`).
    pub(super) fn next(&self, now: Now) -> Option<Mono> {
        let wall = self.wall.peek().map(|Reverse((t, _, _))| now.mono_at(*t));
        [wall, self.mono.peek().map(|Reverse((t, _, _))| *t), self.start_by.next(), self.attempt_deadlines.next()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Timers in the heaps (not the deadlines).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.wall.len() + self.mono.len()
    }

    /// The next due timer: deadlines first, then the two heaps' due heads
    /// in turn while both have one (otherwise the one that has). Not wall
    /// clock timers first, nor the head overdue longer: a `run_all`
    /// catch-up after an outage re-arms a fire at its next missed slot,
    /// overdue by the outage, so either rule held back the runner check,
    /// flushes, wakes and backoffs until the whole catch-up ended.
    pub(super) fn pop_due(&mut self, now: Now) -> Option<Timer> {
        if let Some((run_id, execution_id)) = self.attempt_deadlines.pop_due(now.mono) {
            return Some(Timer::Deadline { run_id, execution_id });
        }
        if let Some(run_id) = self.start_by.pop_due(now.mono) {
            return Some(Timer::StartBy { run_id });
        }
        let wall = self.wall.peek().is_some_and(|Reverse((at, _, _))| *at <= now.wall);
        let mono = self.mono.peek().is_some_and(|Reverse((at, _, _))| *at <= now.mono);
        if !wall && !mono {
            return None;
        }
        if wall && mono {
            self.took_wall = !self.took_wall;
        }
        let take_wall = if wall && mono { self.took_wall } else { wall };
        let t = if take_wall { self.wall.pop().map(|Reverse((_, _, t))| t) } else { self.mono.pop().map(|Reverse((_, _, t))| t) }?;
        if t == Timer::Wake {
            self.wake_at = None;
        }
        Some(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// While a long catch-up keeps wall clock fires due (each overdue by
    /// the outage), a due monotonic timer still goes within the next two.
    #[test]
    fn due_timers_of_both_clocks_take_turns() {
        let wall = DateTime::parse_from_rfc3339("2026-12-01T10:00:00Z").expect("time").with_timezone(&Utc);
        let now = Now::new(wall, Mono::ZERO.after(chrono::Duration::seconds(100)));
        let mut timers = Timers::default();
        let fire = |i: i64| Timer::Fire { task_id: format!("t{i}"), generation: 1 };
        for i in 0..4 {
            // Slots of an hour-old backlog.
            timers.push_wall(wall - chrono::Duration::seconds(3600 - i), fire(i));
        }
        timers.push_mono(Mono::ZERO.after(chrono::Duration::seconds(99)), Timer::RunnerCheck);
        timers.push_mono(Mono::ZERO.after(chrono::Duration::seconds(100)), Timer::Flush);
        let order: Vec<Timer> = std::iter::from_fn(|| timers.pop_due(now)).collect();
        assert_eq!(order, vec![fire(0), Timer::RunnerCheck, fire(1), Timer::Flush, fire(2), fire(3)]);
    }
}
