//! What to do with the slots that came due in a window: fire them, or
//! cover them with one coalesced SKIPPED record (`skip_reason: misfired`).
//!
//! A slot is *on time* when it is the only one due and it is at most
//! `grace` late (Quartz's misfire threshold). Anything else is a misfire and
//! follows the task's [`MisfirePolicy`]:
//! - `run_once`: run the latest slot if it is within the grace;
//! - `run_all`: run every slot within the grace, oldest first;
//! - `skip`: run none.
//!
//! The slots that do not run are covered by ONE skipped record: a burst of
//! runs or silence are both wrong.

use chrono::{DateTime, Duration, Utc};

use super::TimeKind;
use super::{Schedule, next_slot};

/// What to do with slots missed while no scheduler ran (a task's
/// `execution.misfire_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MisfirePolicy {
    /// Run the latest missed slot once, if within the grace (default).
    #[default]
    RunOnce,
    /// Run every missed slot within the grace, oldest first.
    RunAll,
    /// Run none.
    Skip,
}

/// Longest enumeration of slots older than the grace window; past it the
/// coalesced `missed_count` is a lower bound (a per-second cron over 11 days).
const MAX_ENUMERATED: u64 = 1_000_000;

/// The slots due in `(after, now]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotWindow {
    /// Exclusive lower bound: the last slot already handled (or the task's creation).
    pub after: DateTime<Utc>,
    /// Inclusive upper bound: now.
    pub now: DateTime<Utc>,
}

/// Result of [`plan_due_slots`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DuePlan {
    /// Slots to run now, oldest first, with their trigger kind.
    pub run: Vec<(DateTime<Utc>, TimeKind)>,
    /// Slots covered by one SKIPPED record: `(count, first, last)`.
    pub skipped: Option<(u64, DateTime<Utc>, DateTime<Utc>)>,
    /// The new cursor: every slot up to here is handled (`None`: no slot was due).
    pub last_slot: Option<DateTime<Utc>>,
    /// `run_all` had more slots to run than `max_runs`: plan again from
    /// `last_slot`.
    pub more: bool,
}

/// Counts the slots in `(after, until]`: `(count, first, last)`, or `None`
/// when there is none. Stops counting at 1,000,000 (then a lower bound).
pub fn count_slots(schedules: &[Schedule], after: DateTime<Utc>, until: DateTime<Utc>) -> Option<(u64, DateTime<Utc>, DateTime<Utc>)> {
    let mut acc: Option<(u64, DateTime<Utc>, DateTime<Utc>)> = None;
    let mut t = after;
    while let Some((s, _)) = next_slot(schedules, t) {
        if s > until {
            break;
        }
        acc = Some(match acc {
            None => (1, s, s),
            Some((n, f, _)) => (n + 1, f, s),
        });
        if acc.is_some_and(|(n, _, _)| n >= MAX_ENUMERATED) {
            break;
        }
        t = s;
    }
    acc
}

/// Two coalesced ranges as one (the first is older).
fn merge(
    a: Option<(u64, DateTime<Utc>, DateTime<Utc>)>,
    b: Option<(u64, DateTime<Utc>, DateTime<Utc>)>,
) -> Option<(u64, DateTime<Utc>, DateTime<Utc>)> {
    match (a, b) {
        (Some((n, f, _)), Some((m, _, l))) => Some((n + m, f, l)),
        (x, None) | (None, x) => x,
    }
}

/// Plans the slots in `window` under `policy` with `grace` (seconds),
/// running at most `max_runs` slots (only `run_all` can want more; it then
/// says `more` and the caller plans again from `last_slot`).
pub fn plan_due_slots(schedules: &[Schedule], window: SlotWindow, policy: MisfirePolicy, grace_seconds: u64, max_runs: usize) -> DuePlan {
    let SlotWindow { after, now } = window;
    let grace = Duration::seconds(grace_seconds.min(i64::MAX as u64 / 1000) as i64);
    let recent_from = std::cmp::max(after, now.checked_sub_signed(grace).unwrap_or(DateTime::<Utc>::MIN_UTC));

    // Slots older than the grace, and within it: count, first and last only.
    let old = count_slots(schedules, after, recent_from);
    let recent = count_slots(schedules, recent_from, now);
    let kind_at = |t: DateTime<Utc>| next_slot(schedules, t - Duration::milliseconds(1)).map_or(TimeKind::Cron, |(_, s)| s.kind());
    let last_slot = recent.map(|(_, _, l)| l).or(old.map(|(_, _, l)| l));
    // On time: the only due slot, within the grace.
    if let (None, Some((1, _, l))) = (old, recent) {
        return DuePlan { run: vec![(l, kind_at(l))], skipped: None, last_slot, more: false };
    }
    match policy {
        MisfirePolicy::RunOnce => {
            let Some((n, f, l)) = recent else { return DuePlan { run: Vec::new(), skipped: old, last_slot, more: false } };
            // The recent slots before the latest are coalesced with the old ones.
            let left_out =
                if n > 1 { count_slots(schedules, recent_from, l - Duration::milliseconds(1)).map(|(m, _, p)| (m, f, p)) } else { None };
            DuePlan { run: vec![(l, kind_at(l))], skipped: merge(old, left_out), last_slot, more: false }
        }
        MisfirePolicy::Skip => DuePlan { run: Vec::new(), skipped: merge(old, recent), last_slot, more: false },
        MisfirePolicy::RunAll => {
            let mut run = Vec::new();
            let mut t = recent_from;
            let mut more = false;
            while let Some((s, sched)) = next_slot(schedules, t) {
                if s > now {
                    break;
                }
                if run.len() >= max_runs.max(1) {
                    more = true;
                    break;
                }
                run.push((s, sched.kind()));
                t = s;
            }
            let last_slot = if more { run.last().map(|(s, _)| *s) } else { last_slot };
            DuePlan { run, skipped: old, last_slot, more }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> DateTime<Utc> {
        s.parse().expect("timestamp")
    }

    fn every_minute() -> Vec<Schedule> {
        vec![Schedule::plain(crate::schedule::Shape::Interval { period_ms: 60_000, anchor: t("2026-01-01T00:00:00Z"), wall: None })]
    }

    #[test]
    fn on_time_slot_runs_under_every_policy() {
        for p in [MisfirePolicy::RunOnce, MisfirePolicy::RunAll, MisfirePolicy::Skip] {
            let w = SlotWindow { after: t("2026-11-30T10:00:00Z"), now: t("2026-11-30T10:01:00.050Z") };
            let plan = plan_due_slots(&every_minute(), w, p, 60, 50);
            assert_eq!(plan.run, vec![(t("2026-11-30T10:01:00Z"), TimeKind::Interval)]);
            assert_eq!(plan.skipped, None);
        }
    }

    /// An outage of 100+ slots must give one run and one coalesced skip, not a burst.
    #[test]
    fn long_outage_coalesces_under_run_once() {
        let w = SlotWindow { after: t("2026-11-30T08:00:00Z"), now: t("2026-11-30T10:00:30Z") };
        let plan = plan_due_slots(&every_minute(), w, MisfirePolicy::RunOnce, 60, 50);
        assert_eq!(plan.run, vec![(t("2026-11-30T10:00:00Z"), TimeKind::Interval)]);
        assert_eq!(plan.skipped, Some((119, t("2026-11-30T08:01:00Z"), t("2026-11-30T09:59:00Z"))));
        assert_eq!(plan.last_slot, Some(t("2026-11-30T10:00:00Z")));
    }

    #[test]
    fn run_all_runs_only_slots_within_grace() {
        let w = SlotWindow { after: t("2026-11-30T08:00:00Z"), now: t("2026-11-30T10:00:30Z") };
        let plan = plan_due_slots(&every_minute(), w, MisfirePolicy::RunAll, 150, 50);
        assert_eq!(plan.run.iter().map(|r| r.0).collect::<Vec<_>>(), vec![t("2026-11-30T09:59:00Z"), t("2026-11-30T10:00:00Z")]);
        assert_eq!(plan.skipped, Some((118, t("2026-11-30T08:01:00Z"), t("2026-11-30T09:58:00Z"))));
    }

    #[test]
    fn skip_runs_nothing_and_stale_run_once_runs_nothing() {
        let w = SlotWindow { after: t("2026-11-30T08:00:00Z"), now: t("2026-11-30T08:05:30Z") };
        let plan = plan_due_slots(&every_minute(), w, MisfirePolicy::Skip, 60, 50);
        assert!(plan.run.is_empty());
        assert_eq!(plan.skipped, Some((5, t("2026-11-30T08:01:00Z"), t("2026-11-30T08:05:00Z"))));
        let w = SlotWindow { after: t("2026-11-30T08:00:00Z"), now: t("2026-11-30T08:03:30Z") };
        let plan = plan_due_slots(&every_minute(), w, MisfirePolicy::RunOnce, 10, 50);
        assert!(plan.run.is_empty());
        assert_eq!(plan.skipped.map(|s| s.0), Some(3));
    }

    /// A long `run_all` catch-up comes in steps of `max_runs`, the cursor
    /// at the last slot of each step; nothing within the grace is skipped.
    #[test]
    fn run_all_catch_up_comes_in_bounded_steps() {
        let w = SlotWindow { after: t("2026-11-30T08:00:00Z"), now: t("2026-11-30T08:07:30Z") };
        let plan = plan_due_slots(&every_minute(), w, MisfirePolicy::RunAll, 3600, 3);
        assert_eq!(plan.run.len(), 3);
        assert!(plan.more);
        assert_eq!(plan.skipped, None);
        assert_eq!(plan.last_slot, Some(t("2026-11-30T08:03:00Z")));
        let w = SlotWindow { after: t("2026-11-30T08:03:00Z"), now: t("2026-11-30T08:07:30Z") };
        let plan = plan_due_slots(&every_minute(), w, MisfirePolicy::RunAll, 3600, 3);
        assert_eq!(
            plan.run.iter().map(|r| r.0).collect::<Vec<_>>(),
            vec![t("2026-11-30T08:04:00Z"), t("2026-11-30T08:05:00Z"), t("2026-11-30T08:06:00Z")]
        );
        let w = SlotWindow { after: t("2026-11-30T08:06:00Z"), now: t("2026-11-30T08:07:30Z") };
        let plan = plan_due_slots(&every_minute(), w, MisfirePolicy::RunAll, 3600, 3);
        assert!(!plan.more);
        assert_eq!(plan.last_slot, Some(t("2026-11-30T08:07:00Z")));
    }

    /// run_once after an outage: the latest slot runs, every other one is
    /// in one record whose range ends right before it.
    #[test]
    fn run_once_coalesces_the_recent_slots_it_leaves_out() {
        let w = SlotWindow { after: t("2026-11-30T08:00:00Z"), now: t("2026-11-30T08:03:30Z") };
        let plan = plan_due_slots(&every_minute(), w, MisfirePolicy::RunOnce, 600, 50);
        assert_eq!(plan.run, vec![(t("2026-11-30T08:03:00Z"), TimeKind::Interval)]);
        assert_eq!(plan.skipped, Some((2, t("2026-11-30T08:01:00Z"), t("2026-11-30T08:02:00Z"))));
    }
}
