//! Next-fire computation: cron (croner + chrono-tz), interval, once, jitter,
//! and the misfire plan for slots that came due while nothing fired them.
//!
//! Everything here is a pure function of its inputs: no clock reads.

mod cron;
mod misfire;
mod spec;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use std::str::FromStr;

use chrono::{DateTime, Duration, LocalResult, TimeZone, Utc};
use chrono_tz::Tz;

pub use cron::{CronError, CronSchedule, DstRules, Gap, transitions_after};
pub use misfire::{DuePlan, MisfirePolicy, SlotWindow, count_slots, plan_due_slots};
pub use spec::{CronTrigger, DstSpec, GapRule, IntervalTrigger, JitterMode, OnceTrigger, RepeatRule, TimeTrigger};

use crate::error::{Error, Result};

/// A compiled time trigger: where its slots fall ([`Shape`]), the bounds
/// they fall within, and how far each fire is delayed.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// Where the slots fall.
    pub shape: Shape,
    /// No slot before `start` or after `end`; at most `max_runs` runs.
    pub bounds: Bounds,
    /// The delay of each slot's fire.
    pub jitter: Jitter,
}

/// Where a time trigger's slots fall.
#[derive(Debug, Clone)]
pub enum Shape {
    /// Cron expression in a zone (shared: see [`compile`]).
    Cron(Arc<CronSchedule>),
    /// `anchor + k*period`, k ∈ ℤ (elapsed time), or with `wall` the
    /// anchor's local time every `period` days in a zone.
    Interval {
        /// Period in milliseconds (>= 1000).
        period_ms: i64,
        /// Any slot; the phase.
        anchor: DateTime<Utc>,
        /// `wall_clock: true`: the zone and its DST rules.
        wall: Option<(Tz, DstRules)>,
    },
    /// A single instant.
    Once {
        /// The instant.
        at: DateTime<Utc>,
    },
}

/// A time trigger's bounds (README "Bounds and jitter").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bounds {
    /// No slot before it.
    pub start: Option<DateTime<Utc>>,
    /// No slot after it.
    pub end: Option<DateTime<Utc>>,
    /// At most this many runs (the engine counts them in the task's cursor).
    pub max_runs: Option<u64>,
}

/// How far a slot's fire is delayed, deterministically.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jitter {
    /// At the slot.
    None,
    /// `jitter_seconds`: a delay in `[0, bound_ms)` per task and slot.
    PerSlot(u64),
    /// `jitter: auto`: one delay in `[0, bound_ms)` per task, the same
    /// for every slot (bound: a tenth of the period, at most 15 minutes).
    Auto(u64),
}

/// The largest bound of `jitter: auto`: 15 minutes.
pub const AUTO_JITTER_MAX_MS: u64 = 15 * 60 * 1000;

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
    /// A schedule of `shape` with no bounds and no jitter.
    pub fn plain(shape: Shape) -> Schedule {
        Schedule { shape, bounds: Bounds::default(), jitter: Jitter::None }
    }

    /// The first slot strictly after `t` within the bounds' instants (not
    /// `max_runs`: the engine counts runs), or `None` when there is none.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let mut n = match self.bounds.start {
            Some(s) if t < s => self.shape.next_after(s - Duration::seconds(1))?,
            _ => self.shape.next_after(t)?,
        };
        while let Some(s) = self.bounds.start
            && n < s
        {
            n = self.shape.next_after(n)?;
        }
        self.bounds.end.is_none_or(|e| n <= e).then_some(n)
    }

    /// The kind of time trigger its runs come from.
    pub fn kind(&self) -> TimeKind {
        match self.shape {
            Shape::Cron(_) => TimeKind::Cron,
            Shape::Interval { .. } => TimeKind::Interval,
            Shape::Once { .. } => TimeKind::Once,
        }
    }

    /// Jitter bound in milliseconds (0 = none).
    pub fn jitter_ms(&self) -> u64 {
        match self.jitter {
            Jitter::None => 0,
            Jitter::PerSlot(ms) | Jitter::Auto(ms) => ms,
        }
    }

    /// When the slot `slot` of task `task_id` fires: the slot plus its
    /// jitter ([`jitter_for`], or with `jitter: auto` [`auto_offset`]).
    pub fn fire_at(&self, task_id: &str, slot: DateTime<Utc>) -> DateTime<Utc> {
        let d = match self.jitter {
            Jitter::None => return slot,
            Jitter::PerSlot(ms) => jitter_for(task_id, slot, ms),
            Jitter::Auto(ms) => auto_offset(task_id, ms),
        };
        slot.checked_add_signed(d).unwrap_or(slot)
    }

    /// The slots of a DST gap that `gap: skip` records at `slot` instead of
    /// running it (0: `slot` runs).
    pub fn gap_slots(&self, slot: DateTime<Utc>) -> u64 {
        match &self.shape {
            Shape::Cron(c) => c.gap_slots(slot),
            Shape::Interval { wall: Some((tz, rules)), anchor, period_ms } if rules.gap == Gap::Skip => {
                // The slot is a gap's when its day's local time does not exist.
                let local = slot.with_timezone(tz).date_naive();
                let time = anchor.with_timezone(tz).time();
                let days = period_ms / 86_400_000;
                let anchor_day = anchor.with_timezone(tz).date_naive();
                [local.pred_opt(), Some(local)]
                    .into_iter()
                    .flatten()
                    .filter(|d| (*d - anchor_day).num_days().rem_euclid(days) == 0)
                    .filter(|d| matches!(tz.from_local_datetime(&d.and_time(time)), LocalResult::None))
                    .any(|d| cron::gap_jump(*tz, d.and_time(time)) == Some(slot))
                    .into()
            }
            _ => 0,
        }
    }

    /// The zone its slots are read in (cron, wall-clock interval).
    pub fn zone(&self) -> Option<Tz> {
        match &self.shape {
            Shape::Cron(c) => Some(c.timezone()),
            Shape::Interval { wall: Some((tz, _)), .. } => Some(*tz),
            _ => None,
        }
    }

    /// The period `jitter: auto` is a tenth of: an interval's, or a cron
    /// expression's shortest gap between slots (sampled over its next 16
    /// slots from 2001-01-01, so the same for every replica).
    pub fn period_ms(&self) -> Option<u64> {
        match &self.shape {
            Shape::Interval { period_ms, .. } => Some(*period_ms as u64),
            Shape::Once { .. } => None,
            Shape::Cron(c) => c.min_gap_ms(),
        }
    }
}

/// Most DST changes [`Schedule::dst_effects`] looks at.
pub const DST_LOOKAHEAD: usize = 2;

impl Schedule {
    /// What the DST policy does at the zone's next [`DST_LOOKAHEAD`]
    /// changes after `after` (within two years) to slots whose local time
    /// the change skips or repeats, in words: one line per change that
    /// touches a slot (`Europe/Berlin 2027-03-28T01:00:00Z (02:00 → 03:00,
    /// an hour skipped): 3 slot(s) at 02:00, 02:20, 02:40 do not exist;
    /// dst.gap skip: one SKIPPED dst_gap record at the jump`). Empty for
    /// a schedule without a zone or whose slots no change touches.
    pub fn dst_effects(&self, after: DateTime<Utc>) -> Vec<String> {
        let (tz, rules) = match &self.shape {
            Shape::Cron(c) => (c.timezone(), c.dst_rules()),
            Shape::Interval { wall: Some((tz, rules)), .. } => (*tz, *rules),
            _ => return Vec::new(),
        };
        let mut out = Vec::new();
        for (at, before, after_off) in transitions_after(tz, after, DST_LOOKAHEAD) {
            let gap = after_off > before;
            let (lo, hi) = if gap {
                (at.naive_utc() + before, at.naive_utc() + after_off)
            } else {
                (at.naive_utc() + after_off, at.naive_utc() + before)
            };
            let hit: Vec<chrono::NaiveDateTime> = match &self.shape {
                Shape::Cron(c) => c.matches_in(lo, hi, 1000),
                Shape::Interval { anchor, period_ms, .. } => {
                    let local = anchor.with_timezone(&tz);
                    let days = period_ms / 86_400_000;
                    let c = lo.date().and_time(local.time());
                    let on_day = (c.date() - local.date_naive()).num_days().rem_euclid(days) == 0;
                    if c >= lo && c < hi && on_day { vec![c] } else { Vec::new() }
                }
                Shape::Once { .. } => Vec::new(),
            };
            if hit.is_empty() || self.bounds.end.is_some_and(|e| e < at - Duration::hours(3)) {
                continue;
            }
            let shown: Vec<String> = hit.iter().take(6).map(|c| c.format("%H:%M:%S").to_string()).collect();
            let more = if hit.len() > 6 { format!(" and {} more", hit.len() - 6) } else { String::new() };
            let fmt = |o: Duration| {
                let m = o.num_minutes();
                format!("{}{:02}:{:02}", if m < 0 { '-' } else { '+' }, m.abs() / 60, m.abs() % 60)
            };
            let change =
                format!("{tz} {} (UTC{} → UTC{})", at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true), fmt(before), fmt(after_off));
            let what = if gap {
                match rules.gap {
                    Gap::Shift => {
                        format!("dst.gap shift: they run once at the jump, {}", at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
                    }
                    Gap::Skip => "dst.gap skip: one SKIPPED dst_gap record at the jump, no run".to_string(),
                    Gap::Omit => {
                        "they do not run and leave no record (cronie's rule for * and steps; set dst.gap to shift or skip to choose)"
                            .to_string()
                    }
                }
            } else {
                match rules.repeat {
                    RepeatRule::First => "dst.repeat first: each runs once, at its first occurrence".to_string(),
                    RepeatRule::Last => "dst.repeat last: each runs once, at its second occurrence".to_string(),
                    RepeatRule::Both => "dst.repeat both: each runs twice, each occurrence its own run".to_string(),
                }
            };
            let kind = if gap { "do not exist" } else { "happen twice" };
            out.push(format!("{change}: {} slot(s) at {}{more} local {kind}; {what}", hit.len(), shown.join(", ")));
        }
        out
    }
}

impl Shape {
    /// The first slot strictly after `t`, ignoring bounds.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match self {
            Shape::Cron(c) => c.next_after(t),
            Shape::Interval { period_ms, anchor, wall: None } => {
                let since = (t - *anchor).num_milliseconds();
                let k = since.div_euclid(*period_ms) + 1;
                Some(*anchor + Duration::milliseconds(k * period_ms))
            }
            Shape::Interval { period_ms, anchor, wall: Some((tz, rules)) } => {
                // Every `days` days at the anchor's local time.
                let days = period_ms / 86_400_000;
                let local = anchor.with_timezone(tz);
                let (anchor_day, time) = (local.date_naive(), local.time());
                let since = (t.with_timezone(tz).date_naive() - anchor_day).num_days();
                let first = since.div_euclid(days) - 1;
                (first..first + 4).find_map(|k| {
                    let day = anchor_day.checked_add_signed(Duration::days(k * days))?;
                    rules.instants(*tz, day.and_time(time)).into_iter().find(|i| *i > t)
                })
            }
            Shape::Once { at } => (*at > t).then_some(*at),
        }
    }
}

/// The earliest slot strictly after `t` over several schedules, with the
/// kind of the schedule that produced it.
pub fn next_slot(schedules: &[Schedule], t: DateTime<Utc>) -> Option<(DateTime<Utc>, &Schedule)> {
    schedules.iter().filter_map(|s| s.next_after(t).map(|n| (n, s))).min_by_key(|(n, _)| *n)
}

/// FNV-1a over bytes.
fn fnv(bytes: impl IntoIterator<Item = u8>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Deterministic jitter for a slot: a delay in `[0, jitter_ms)` milliseconds
/// derived from the task id and the slot instant (FNV-1a), so every replica
/// and every restart computes the same fire time for the same slot.
pub fn jitter_for(task_id: &str, slot: DateTime<Utc>, jitter_ms: u64) -> Duration {
    if jitter_ms == 0 {
        return Duration::zero();
    }
    let h = fnv(task_id.bytes().chain(slot.timestamp_millis().to_le_bytes()));
    Duration::milliseconds((h % jitter_ms) as i64)
}

/// `jitter: auto`'s delay for a task: in `[0, bound_ms)` milliseconds,
/// from the task id alone (FNV-1a), so the task fires at the same offset
/// after every slot, on every replica, across restarts.
pub fn auto_offset(task_id: &str, bound_ms: u64) -> Duration {
    if bound_ms == 0 {
        return Duration::zero();
    }
    Duration::milliseconds((fnv(task_id.bytes()) % bound_ms) as i64)
}

/// `jitter: auto`'s bound for a period: a tenth, at most
/// [`AUTO_JITTER_MAX_MS`] (Claude Code's scheduler derives the same
/// from a task's period).
pub fn auto_jitter_bound(period_ms: u64) -> u64 {
    (period_ms / 10).min(AUTO_JITTER_MAX_MS)
}

/// Most distinct cron schedules [`compile`] keeps parsed (each holds a
/// year bitmap of about 5 KB, so at most about 2.5 MB); past it the cache
/// starts again empty.
pub const CRON_CACHE_ENTRIES: usize = 512;

/// `(expr, zone, dst)` → its parsed schedule. Tasks share expressions
/// (ten thousand tasks on `* * * * * *` are one entry), and the engine
/// compiles a task's triggers at each fire rather than keep them per task:
/// parsing showed as 12% of the leader's CPU at 1,000 runs a second.
type CronKey = (String, String, DstSpec);
static CRON_CACHE: Mutex<Option<HashMap<CronKey, Arc<CronSchedule>>>> = Mutex::new(None);

/// [`CronSchedule::parse`], through the process-wide cache of
/// [`CRON_CACHE_ENTRIES`] schedules. Errors are not cached.
pub fn parse_cron(expr: &str, tz: &str, dst: DstSpec) -> std::result::Result<Arc<CronSchedule>, CronError> {
    let key = (expr.to_string(), tz.to_string(), dst);
    if let Some(hit) = CRON_CACHE.lock().ok().and_then(|c| c.as_ref().and_then(|m| m.get(&key).cloned())) {
        return Ok(hit);
    }
    let parsed = Arc::new(CronSchedule::parse(expr, tz, dst)?);
    if let Ok(mut cache) = CRON_CACHE.lock() {
        let map = cache.get_or_insert_with(HashMap::new);
        if map.len() >= CRON_CACHE_ENTRIES {
            map.clear();
        }
        map.insert(key, parsed.clone());
    }
    Ok(parsed)
}

/// An IANA zone by name, or an error at `field`.
fn zone(field: String, name: &str) -> Result<Tz> {
    Tz::from_str(name)
        .map_err(|_| Error::invalid(field, format!("unknown time zone {name:?} (use an IANA name such as \"Asia/Shanghai\")")))
}

/// The jitter of a trigger: `jitter_seconds` or `jitter: auto` (a tenth of
/// `period_ms`, at most 15 minutes; none for a trigger without a period).
fn jitter_of(path: &str, seconds: u64, mode: Option<JitterMode>, period_ms: Option<u64>) -> Result<Jitter> {
    match (seconds, mode) {
        (0, None) => Ok(Jitter::None),
        (s, None) => Ok(Jitter::PerSlot(s.saturating_mul(1000))),
        (0, Some(JitterMode::Auto)) => Ok(period_ms.map_or(Jitter::None, |p| Jitter::Auto(auto_jitter_bound(p)))),
        (_, Some(_)) => Err(Error::invalid(format!("{path}.jitter"), "give either jitter: auto or jitter_seconds, not both")),
    }
}

/// Bounds as written; `end_at` before `start_at` and `max_runs: 0` refused.
fn bounds_of(path: &str, start: Option<DateTime<Utc>>, end: Option<DateTime<Utc>>, max_runs: Option<u64>) -> Result<Bounds> {
    if let (Some(s), Some(e)) = (start, end)
        && e < s
    {
        return Err(Error::invalid(format!("{path}.end_at"), format!("{e} is before start_at {s}")));
    }
    if max_runs == Some(0) {
        return Err(Error::invalid(format!("{path}.max_runs"), "must be at least 1 (leave it out for no bound)"));
    }
    Ok(Bounds { start, end, max_runs })
}

/// Compiles a time trigger. `path` is the field path used in errors
/// (`trigger`, `triggers[1]`). Cron schedules come from a bounded cache
/// ([`parse_cron`]): compiling the same expression again is a lookup.
pub fn compile(t: TimeTrigger<'_>, path: &str) -> Result<Schedule> {
    match t {
        TimeTrigger::Cron(c) => {
            let tz = c.timezone.as_deref().unwrap_or("UTC");
            let s = parse_cron(&c.expr, tz, c.dst.unwrap_or_default()).map_err(|e| e.at(path))?;
            let mut out = Schedule::plain(Shape::Cron(s));
            out.bounds = bounds_of(path, c.start_at, c.end_at, c.max_runs)?;
            // The period is worked out only for `jitter: auto` (issue 38: it
            // was a third of the core's CPU per slot, compiled at each fire).
            let period = if c.jitter == Some(JitterMode::Auto) { out.period_ms() } else { None };
            out.jitter = jitter_of(path, c.jitter_seconds, c.jitter, period)?;
            Ok(out)
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
            let wall = if i.wall_clock {
                if period_s % 86_400 != 0 {
                    return Err(Error::invalid(
                        format!("{path}.wall_clock"),
                        format!("needs a period of whole days (every: {period_s}s is not); use a cron expression for times of day"),
                    ));
                }
                let tz = zone(format!("{path}.timezone"), i.timezone.as_deref().unwrap_or("UTC"))?;
                Some((tz, DstRules::resolve(i.dst.unwrap_or_default(), true)))
            } else {
                if i.timezone.is_some() {
                    return Err(Error::invalid(
                        format!("{path}.timezone"),
                        "only with wall_clock: true (an interval of elapsed time has no zone)",
                    ));
                }
                if i.dst.is_some() {
                    return Err(Error::invalid(
                        format!("{path}.dst"),
                        "only with wall_clock: true (an interval of elapsed time meets no DST change)",
                    ));
                }
                None
            };
            let anchor = i.start_at.unwrap_or_else(|| Utc.timestamp_opt(0, 0).single().unwrap_or_default());
            let mut out = Schedule::plain(Shape::Interval { period_ms: (period_s as i64) * 1000, anchor, wall });
            out.bounds = bounds_of(path, i.start_at, i.end_at, i.max_runs)?;
            out.jitter = jitter_of(path, i.jitter_seconds, i.jitter, Some(period_s * 1000))?;
            Ok(out)
        }
        TimeTrigger::Once(o) => Ok(Schedule::plain(Shape::Once { at: o.at })),
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
        let s = Schedule::plain(Shape::Interval { period_ms: 120_000, anchor: t("2026-01-01T00:00:00Z"), wall: None });
        assert_eq!(s.next_after(t("2026-11-30T10:00:00Z")), Some(t("2026-11-30T10:02:00Z")));
        assert_eq!(s.next_after(t("2026-11-30T10:01:59.999Z")), Some(t("2026-11-30T10:02:00Z")));
        assert_eq!(s.next_after(t("2025-12-31T23:59:00Z")), Some(t("2026-01-01T00:00:00Z")));
    }

    /// The same (expr, zone, jitter) is parsed once and shared; another
    /// zone or jitter is another schedule; errors are not kept; the cache
    /// never holds more than its bound.
    #[test]
    fn cron_schedules_are_shared_and_bounded() {
        let d = DstSpec::default();
        let a = parse_cron("17 3 * * *", "Asia/Shanghai", d).expect("parse");
        let b = parse_cron("17 3 * * *", "Asia/Shanghai", d).expect("parse");
        assert!(Arc::ptr_eq(&a, &b));
        let other_zone = parse_cron("17 3 * * *", "UTC", d).expect("parse");
        assert!(!Arc::ptr_eq(&a, &other_zone));
        assert_ne!(a.next_after(t("2026-12-01T00:00:00Z")), other_zone.next_after(t("2026-12-01T00:00:00Z")));
        let skip = DstSpec { gap: Some(GapRule::Skip), repeat: None };
        let other_policy = parse_cron("17 3 * * *", "Asia/Shanghai", skip).expect("parse");
        assert!(!Arc::ptr_eq(&a, &other_policy));
        assert_eq!(other_policy.dst_rules().gap, Gap::Skip);
        assert!(parse_cron("61 3 * * *", "UTC", d).is_err());
        assert!(parse_cron("61 3 * * *", "UTC", d).is_err(), "a refused expression stays refused");
        for m in 0..CRON_CACHE_ENTRIES + 10 {
            let _ = parse_cron(&format!("{} {} * * *", m % 60, m / 60 % 24), &format!("Etc/GMT+{}", m / 1440 % 12), d);
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

    fn field(e: Error) -> String {
        match e {
            Error::InvalidArgument { field, .. } => field,
            e => format!("{e}"),
        }
    }

    /// The slots of `s` in `[from, until)`, as the DST cases write them.
    fn slots_in(s: &Schedule, from: DateTime<Utc>, until: DateTime<Utc>) -> Vec<String> {
        let mut out = Vec::new();
        let mut at = from - Duration::seconds(1);
        while let Some(n) = s.next_after(at) {
            if n >= until {
                break;
            }
            let stamp = n.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
            out.push(match s.gap_slots(n) {
                0 => stamp,
                g => format!("{stamp} dst_gap {g}"),
            });
            at = n;
        }
        out
    }

    /// The DST case table (`tests/cases/dst.json`, values worked out by
    /// hand from each zone's offsets): New York, Berlin, Lord Howe (a
    /// 30-minute change) and Santiago (changes at midnight), a fixed-time
    /// and a stepped expression through both 2026 changes under each
    /// policy; and daily intervals on the wall clock.
    #[test]
    fn dst_cases_hold() {
        let v: serde_json::Value = serde_json::from_str(include_str!("../../../tests/cases/dst.json")).expect("cases parse");
        let mut checked = 0;
        for c in v["cases"].as_array().expect("cases") {
            let id = c["id"].as_str().expect("id");
            let (from, until) = (t(c["from"].as_str().expect("from")), t(c["until"].as_str().expect("until")));
            for (policy, want) in c["expect"].as_object().expect("expect") {
                let dst = match policy.as_str() {
                    "default" => None,
                    "shift" => Some(DstSpec { gap: Some(GapRule::Shift), repeat: None }),
                    "skip" => Some(DstSpec { gap: Some(GapRule::Skip), repeat: None }),
                    "first" => Some(DstSpec { gap: None, repeat: Some(RepeatRule::First) }),
                    "last" => Some(DstSpec { gap: None, repeat: Some(RepeatRule::Last) }),
                    "both" => Some(DstSpec { gap: None, repeat: Some(RepeatRule::Both) }),
                    p => panic!("{id}: unknown policy {p}"),
                };
                let trig = CronTrigger {
                    expr: c["expr"].as_str().expect("expr").into(),
                    timezone: Some(c["zone"].as_str().expect("zone").into()),
                    dst,
                    ..Default::default()
                };
                let s = compile(TimeTrigger::Cron(&trig), "trigger").expect("compiles");
                let want: Vec<String> = want.as_array().expect("list").iter().map(|x| x.as_str().expect("slot").to_string()).collect();
                assert_eq!(slots_in(&s, from, until), want, "{id} under {policy}");
                checked += 1;
            }
        }
        for c in v["wall_clock"].as_array().expect("wall_clock") {
            let id = c["id"].as_str().expect("id");
            let zone = c["zone"].as_str().expect("zone");
            let trig = IntervalTrigger {
                every: Some(c["every"].as_str().expect("every").into()),
                start_at: Some(t(c["start_at"].as_str().expect("start_at"))),
                wall_clock: !zone.is_empty(),
                timezone: (!zone.is_empty()).then(|| zone.to_string()),
                ..Default::default()
            };
            let s = compile(TimeTrigger::Interval(&trig), "trigger").expect("compiles");
            let want: Vec<String> = c["expect"].as_array().expect("list").iter().map(|x| x.as_str().expect("slot").to_string()).collect();
            let (from, until) = (t(c["from"].as_str().expect("from")), t(c["until"].as_str().expect("until")));
            assert_eq!(slots_in(&s, from, until), want, "{id}");
            checked += 1;
        }
        assert!(checked >= 60, "{checked} cases checked");
    }

    /// `start_at`, `end_at`: no slot outside them; `max_runs: 0` and an
    /// end before the start refused, naming the field.
    #[test]
    fn bounds_hold_and_are_checked() {
        let trig = CronTrigger {
            expr: "0 * * * *".into(),
            start_at: Some(t("2026-12-01T10:30:00Z")),
            end_at: Some(t("2026-12-01T13:00:00Z")),
            ..Default::default()
        };
        let s = compile(TimeTrigger::Cron(&trig), "trigger").expect("compiles");
        assert_eq!(
            slots_in(&s, t("2026-12-01T00:00:00Z"), t("2026-12-02T00:00:00Z")),
            ["2026-12-01T11:00:00Z", "2026-12-01T12:00:00Z", "2026-12-01T13:00:00Z"]
        );
        let bad = CronTrigger { end_at: Some(t("2026-12-01T10:00:00Z")), ..trig.clone() };
        assert_eq!(field(compile(TimeTrigger::Cron(&bad), "trigger").expect_err("end before start")), "trigger.end_at");
        let zero = CronTrigger { max_runs: Some(0), ..trig.clone() };
        assert_eq!(field(compile(TimeTrigger::Cron(&zero), "trigger").expect_err("zero")), "trigger.max_runs");
        // An interval's start_at is its first slot, not only its phase.
        let iv = IntervalTrigger { every: Some("10m".into()), start_at: Some(t("2026-12-01T10:05:00Z")), ..Default::default() };
        let s = compile(TimeTrigger::Interval(&iv), "trigger").expect("compiles");
        assert_eq!(s.next_after(t("2026-12-01T09:00:00Z")), Some(t("2026-12-01T10:05:00Z")));
        let not_days = IntervalTrigger { every: Some("36h".into()), wall_clock: true, ..Default::default() };
        assert_eq!(field(compile(TimeTrigger::Interval(&not_days), "trigger").expect_err("36h")), "trigger.wall_clock");
    }

    /// `jitter: auto`: a tenth of the period, at most 15 minutes; the same
    /// offset for every slot of a task; spread over tasks.
    #[test]
    fn auto_jitter_is_a_tenth_of_the_period_per_task() {
        let trig = |expr: &str| CronTrigger { expr: expr.into(), jitter: Some(JitterMode::Auto), ..Default::default() };
        let hourly = compile(TimeTrigger::Cron(&trig("0 * * * *")), "trigger").expect("compiles");
        assert_eq!(hourly.jitter, Jitter::Auto(360_000));
        let daily = compile(TimeTrigger::Cron(&trig("0 9 * * 1-5")), "trigger").expect("compiles");
        assert_eq!(daily.jitter, Jitter::Auto(AUTO_JITTER_MAX_MS));
        let minutely = compile(TimeTrigger::Cron(&trig("* * * * *")), "trigger").expect("compiles");
        assert_eq!(minutely.jitter, Jitter::Auto(6_000));
        let (a, b) = (t("2026-12-01T10:00:00Z"), t("2026-12-01T11:00:00Z"));
        assert_eq!(hourly.fire_at("task-1", a) - a, hourly.fire_at("task-1", b) - b, "the same offset every slot");
        let offsets: std::collections::HashSet<i64> =
            (0..500).map(|i| (hourly.fire_at(&format!("task-{i}"), a) - a).num_milliseconds()).collect();
        assert!(offsets.len() > 450 && offsets.iter().all(|o| (0..360_000).contains(o)), "{} distinct", offsets.len());
        let both = CronTrigger { jitter_seconds: 5, ..trig("0 * * * *") };
        assert_eq!(field(compile(TimeTrigger::Cron(&both), "trigger").expect_err("both")), "trigger.jitter");
    }
}
