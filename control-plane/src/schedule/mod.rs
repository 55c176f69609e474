//! Next-fire computation: cron (croner + chrono-tz), interval, once, jitter,
//! and the misfire plan for slots that came due while nothing fired them.
//!
//! Everything here is a pure function of its inputs: no clock reads.

mod cron;
mod misfire;
mod spec;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Duration, TimeZone, Utc};

pub use cron::{CronError, CronSchedule};
pub use misfire::{DuePlan, MisfirePolicy, SlotWindow, count_slots, plan_due_slots};
pub use spec::{CronTrigger, IntervalTrigger, OnceTrigger, TimeTrigger};

use crate::error::{Error, Result};

/// A compiled time trigger.
#[derive(Debug, Clone)]
pub enum Schedule {
    /// Cron expression in a zone (shared: see [`compile`]).
    Cron(Arc<CronSchedule>),
    /// `anchor + k*period`, k ∈ ℤ.
    Interval {
        /// Period in milliseconds (>= 1000).
        period_ms: i64,
        /// Any slot; the phase.
        anchor: DateTime<Utc>,
        /// Jitter bound in milliseconds.
        jitter_ms: u64,
    },
    /// A single instant.
    Once {
        /// The instant.
        at: DateTime<Utc>,
    },
}

/// The kind of time trigger a slot comes from: a run's trigger kind
/// (`model::run::TriggerKind` converts from it; this module knows nothing
/// of runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TimeKind {
    /// A cron expression's slot.
    Cron,
    /// An interval's slot.
    Interval,
    /// A `once` trigger's instant.
    Once,
}

impl Schedule {
    /// The first slot strictly after `t`, or `None` when there is none.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match self {
            Schedule::Cron(c) => c.next_after(t),
            Schedule::Interval { period_ms, anchor, .. } => {
                let since = (t - *anchor).num_milliseconds();
                let k = since.div_euclid(*period_ms) + 1;
                Some(*anchor + Duration::milliseconds(k * period_ms))
            }
            Schedule::Once { at } => (*at > t).then_some(*at),
        }
    }

    /// The kind of time trigger its runs come from.
    pub fn kind(&self) -> TimeKind {
        match self {
            Schedule::Cron(_) => TimeKind::Cron,
            Schedule::Interval { .. } => TimeKind::Interval,
            Schedule::Once { .. } => TimeKind::Once,
        }
    }

    /// Jitter bound in milliseconds (0 = none).
    pub fn jitter_ms(&self) -> u64 {
        match self {
            Schedule::Cron(c) => c.jitter_ms,
            Schedule::Interval { jitter_ms, .. } => *jitter_ms,
            Schedule::Once { .. } => 0,
        }
    }
}

/// The earliest slot strictly after `t` over several schedules, with the
/// kind of the schedule that produced it.
pub fn next_slot(schedules: &[Schedule], t: DateTime<Utc>) -> Option<(DateTime<Utc>, &Schedule)> {
    schedules.iter().filter_map(|s| s.next_after(t).map(|n| (n, s))).min_by_key(|(n, _)| *n)
}

/// Deterministic jitter for a slot: a delay in `[0, jitter_ms)` milliseconds
/// derived from the task id and the slot instant (FNV-1a), so every replica
/// and every restart computes the same fire time for the same slot.
pub fn jitter_for(task_id: &str, slot: DateTime<Utc>, jitter_ms: u64) -> Duration {
    if jitter_ms == 0 {
        return Duration::zero();
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in task_id.bytes().chain(slot.timestamp_millis().to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    Duration::milliseconds((h % jitter_ms) as i64)
}

/// Most distinct cron schedules [`compile`] keeps parsed (each holds a
/// year bitmap of about 5 KB, so at most about 2.5 MB); past it the cache
/// starts again empty.
pub const CRON_CACHE_ENTRIES: usize = 512;

/// `(expr, zone, jitter_ms)` → its parsed schedule. Tasks share
/// expressions (ten thousand tasks on `* * * * * *` are one entry), and the
/// engine compiles a task's triggers at each fire rather than keep them per
/// task: parsing showed as 12% of the leader's CPU at 1,000 runs a second.
type CronKey = (String, String, u64);
static CRON_CACHE: Mutex<Option<HashMap<CronKey, Arc<CronSchedule>>>> = Mutex::new(None);

/// [`CronSchedule::parse`], through the process-wide cache of
/// [`CRON_CACHE_ENTRIES`] schedules. Errors are not cached.
pub fn parse_cron(expr: &str, tz: &str, jitter_ms: u64) -> std::result::Result<Arc<CronSchedule>, CronError> {
    let key = (expr.to_string(), tz.to_string(), jitter_ms);
    if let Some(hit) = CRON_CACHE.lock().ok().and_then(|c| c.as_ref().and_then(|m| m.get(&key).cloned())) {
        return Ok(hit);
    }
    let parsed = Arc::new(CronSchedule::parse(expr, tz, jitter_ms)?);
    if let Ok(mut cache) = CRON_CACHE.lock() {
        let map = cache.get_or_insert_with(HashMap::new);
        if map.len() >= CRON_CACHE_ENTRIES {
            map.clear();
        }
        map.insert(key, parsed.clone());
    }
    Ok(parsed)
}

/// Compiles a time trigger. `path` is the field path used in errors
/// (`trigger`, `triggers[1]`). Cron schedules come from a bounded cache
/// ([`parse_cron`]): compiling the same expression again is a lookup.
pub fn compile(t: TimeTrigger<'_>, path: &str) -> Result<Schedule> {
    match t {
        TimeTrigger::Cron(c) => {
            let tz = c.timezone.as_deref().unwrap_or("UTC");
            let s = parse_cron(&c.expr, tz, c.jitter_seconds.saturating_mul(1000)).map_err(|e| e.at(path))?;
            Ok(Schedule::Cron(s))
        }
        TimeTrigger::Interval(i) => {
            let period_s = match (&i.every, i.every_seconds) {
                (Some(_), Some(_)) => {
                    return Err(Error::invalid(format!("{path}.every_seconds"), "give either every or every_seconds, not both"));
                }
                (Some(e), None) => parse_duration(e).map_err(|r| Error::invalid(format!("{path}.every"), r))?,
                (None, Some(s)) => s,
                (None, None) => return Err(Error::invalid(format!("{path}.every"), "required (or every_seconds)")),
            };
            if period_s == 0 {
                return Err(Error::invalid(format!("{path}.every"), "must be at least 1s"));
            }
            if period_s > 366 * 86_400 * 100 {
                return Err(Error::invalid(format!("{path}.every"), "must be at most 100 years"));
            }
            Ok(Schedule::Interval {
                period_ms: (period_s as i64) * 1000,
                anchor: i.start_at.unwrap_or_else(|| Utc.timestamp_opt(0, 0).single().unwrap_or_default()),
                jitter_ms: i.jitter_seconds.saturating_mul(1000),
            })
        }
        TimeTrigger::Once(o) => Ok(Schedule::Once { at: o.at }),
    }
}

/// Parses `"90s"`, `"10m"`, `"2h"`, `"1d"`, `"1h30m"` into seconds. Units
/// go from the largest down, each at most once (`"1h1h"` is refused).
pub fn parse_duration(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("empty duration".into());
    }
    let mut total: u64 = 0;
    let mut num = String::new();
    let mut last_unit = u64::MAX;
    for c in s.chars() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let unit = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86_400,
            _ => return Err(format!("{s:?}: unknown unit {c:?} (use s, m, h, d)")),
        };
        if unit >= last_unit {
            return Err(format!("{s:?}: units go from the largest down, each once (as in \"1d2h30m\")"));
        }
        last_unit = unit;
        let n: u64 = num.parse().map_err(|_| format!("{s:?}: expected a number before {c:?}"))?;
        total = n.checked_mul(unit).and_then(|v| total.checked_add(v)).ok_or_else(|| format!("{s:?}: too long"))?;
        num.clear();
    }
    if !num.is_empty() {
        return Err(format!("{s:?}: number without a unit (e.g. \"{num}s\")"));
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> DateTime<Utc> {
        s.parse().expect("timestamp")
    }

    #[test]
    fn interval_is_anchored_and_never_drifts() {
        let s = Schedule::Interval { period_ms: 120_000, anchor: t("2026-01-01T00:00:00Z"), jitter_ms: 0 };
        assert_eq!(s.next_after(t("2026-11-30T10:00:00Z")), Some(t("2026-11-30T10:02:00Z")));
        assert_eq!(s.next_after(t("2026-11-30T10:01:59.999Z")), Some(t("2026-11-30T10:02:00Z")));
        assert_eq!(s.next_after(t("2025-12-31T23:59:00Z")), Some(t("2026-01-01T00:00:00Z")));
    }

    /// The same (expr, zone, jitter) is parsed once and shared; another
    /// zone or jitter is another schedule; errors are not kept; the cache
    /// never holds more than its bound.
    #[test]
    fn cron_schedules_are_shared_and_bounded() {
        let a = parse_cron("17 3 * * *", "Asia/Shanghai", 0).expect("parse");
        let b = parse_cron("17 3 * * *", "Asia/Shanghai", 0).expect("parse");
        assert!(Arc::ptr_eq(&a, &b));
        let other_zone = parse_cron("17 3 * * *", "UTC", 0).expect("parse");
        assert!(!Arc::ptr_eq(&a, &other_zone));
        assert_ne!(a.next_after(t("2026-12-01T00:00:00Z")), other_zone.next_after(t("2026-12-01T00:00:00Z")));
        let jittered = parse_cron("17 3 * * *", "Asia/Shanghai", 5_000).expect("parse");
        assert_eq!(jittered.jitter_ms, 5_000);
        assert!(parse_cron("61 3 * * *", "UTC", 0).is_err());
        assert!(parse_cron("61 3 * * *", "UTC", 0).is_err(), "a refused expression stays refused");
        for m in 0..CRON_CACHE_ENTRIES + 10 {
            let _ = parse_cron(&format!("{} {} * * *", m % 60, m / 60 % 24), &format!("Etc/GMT+{}", m / 1440 % 12), m as u64);
        }
        let held = CRON_CACHE.lock().expect("lock").as_ref().map_or(0, HashMap::len);
        assert!(held <= CRON_CACHE_ENTRIES, "{held} schedules cached");
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("10m"), Ok(600));
        assert_eq!(parse_duration("1h30m"), Ok(5400));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("10x").is_err());
        assert!(parse_duration("1h1h").unwrap_err().contains("largest down"));
        assert!(parse_duration("30m1h").is_err());
    }

    #[test]
    fn jitter_is_deterministic_and_bounded() {
        let slot = t("2026-11-30T00:30:00Z");
        let a = jitter_for("t", slot, 30_000);
        assert_eq!(a, jitter_for("t", slot, 30_000));
        assert!(a >= Duration::zero() && a < Duration::seconds(30));
        assert_ne!(jitter_for("t", slot, 30_000), jitter_for("u", slot, 30_000));
    }
}
