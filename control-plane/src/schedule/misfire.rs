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

use super::{Schedule, next_slot};
use crate::model::task::MisfirePolicy;

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
    pub run: Vec<(DateTime<Utc>, &'static str)>,
    /// Slots covered by one SKIPPED record: `(count, first, last)`.
    pub skipped: Option<(u64, DateTime<Utc>, DateTime<Utc>)>,
    /// Latest slot in the window (the new cursor), if any slot was due.
    pub last_slot: Option<DateTime<Utc>>,
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

/// Plans the slots in `window` under `policy` with `grace` (seconds).
pub fn plan_due_slots(schedules: &[Schedule], window: SlotWindow, policy: MisfirePolicy, grace_seconds: u64) -> DuePlan {
    let SlotWindow { after, now } = window;
    let grace = Duration::seconds(grace_seconds.min(i64::MAX as u64 / 1000) as i64);
    let recent_from = std::cmp::max(after, now.checked_sub_signed(grace).unwrap_or(DateTime::<Utc>::MIN_UTC));

    // Slots older than the grace: count, first and last only.
    let old = count_slots(schedules, after, recent_from);
    // Slots within the grace: all of them (bounded by grace / period).
    let mut recent: Vec<(DateTime<Utc>, &'static str)> = Vec::new();
    let mut t = recent_from;
    while let Some((s, sched)) = next_slot(schedules, t) {
        if s > now {
            break;
        }
        recent.push((s, sched.kind()));
        t = s;
    }

    let last_slot = recent.last().map(|(s, _)| *s).or(old.map(|(_, _, l)| l));
    if old.is_none() && recent.len() == 1 {
        return DuePlan { run: recent, skipped: None, last_slot };
    }
    let run: Vec<(DateTime<Utc>, &'static str)> = match policy {
        MisfirePolicy::RunOnce => recent.last().copied().into_iter().collect(),
        MisfirePolicy::RunAll => recent.clone(),
        MisfirePolicy::Skip => Vec::new(),
    };
    // Everything not run is coalesced: the old slots plus the recent ones left out.
    let mut skipped = old;
    for (s, _) in recent.iter().filter(|r| !run.contains(r)) {
        skipped = Some(match skipped {
            None => (1, *s, *s),
            Some((n, f, _)) => (n + 1, f, *s),
        });
    }
    DuePlan { run, skipped, last_slot }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> DateTime<Utc> {
        s.parse().expect("timestamp")
    }

    fn every_minute() -> Vec<Schedule> {
        vec![Schedule::Interval { period_ms: 60_000, anchor: t("2026-01-01T00:00:00Z"), jitter_ms: 0 }]
    }

    #[test]
    fn on_time_slot_runs_under_every_policy() {
        for p in [MisfirePolicy::RunOnce, MisfirePolicy::RunAll, MisfirePolicy::Skip] {
            let w = SlotWindow { after: t("2026-11-30T10:00:00Z"), now: t("2026-11-30T10:01:00.050Z") };
            let plan = plan_due_slots(&every_minute(), w, p, 60);
            assert_eq!(plan.run, vec![(t("2026-11-30T10:01:00Z"), "interval")]);
            assert_eq!(plan.skipped, None);
        }
    }

    /// An outage of 100+ slots must give one run and one coalesced skip, not a burst.
    #[test]
    fn long_outage_coalesces_under_run_once() {
        let w = SlotWindow { after: t("2026-11-30T08:00:00Z"), now: t("2026-11-30T10:00:30Z") };
        let plan = plan_due_slots(&every_minute(), w, MisfirePolicy::RunOnce, 60);
        assert_eq!(plan.run, vec![(t("2026-11-30T10:00:00Z"), "interval")]);
        assert_eq!(plan.skipped, Some((119, t("2026-11-30T08:01:00Z"), t("2026-11-30T09:59:00Z"))));
        assert_eq!(plan.last_slot, Some(t("2026-11-30T10:00:00Z")));
    }

    #[test]
    fn run_all_runs_only_slots_within_grace() {
        let w = SlotWindow { after: t("2026-11-30T08:00:00Z"), now: t("2026-11-30T10:00:30Z") };
        let plan = plan_due_slots(&every_minute(), w, MisfirePolicy::RunAll, 150);
        assert_eq!(plan.run.iter().map(|r| r.0).collect::<Vec<_>>(), vec![t("2026-11-30T09:59:00Z"), t("2026-11-30T10:00:00Z")]);
        assert_eq!(plan.skipped, Some((118, t("2026-11-30T08:01:00Z"), t("2026-11-30T09:58:00Z"))));
    }

    #[test]
    fn skip_runs_nothing_and_stale_run_once_runs_nothing() {
        let w = SlotWindow { after: t("2026-11-30T08:00:00Z"), now: t("2026-11-30T08:05:30Z") };
        let plan = plan_due_slots(&every_minute(), w, MisfirePolicy::Skip, 60);
        assert!(plan.run.is_empty());
        assert_eq!(plan.skipped, Some((5, t("2026-11-30T08:01:00Z"), t("2026-11-30T08:05:00Z"))));
        let w = SlotWindow { after: t("2026-11-30T08:00:00Z"), now: t("2026-11-30T08:03:30Z") };
        let plan = plan_due_slots(&every_minute(), w, MisfirePolicy::RunOnce, 10);
        assert!(plan.run.is_empty());
        assert_eq!(plan.skipped.map(|s| s.0), Some(3));
    }
}
