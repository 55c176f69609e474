//! Time triggers as users write them (`{type: cron | interval | once, ...}`
//! in a task's `trigger`/`triggers`): `schedule/` owns them, compiles them
//! ([`super::compile`]) and plans their slots. The other trigger kinds
//! (webhook, queue, event, after) are not time: `model::trigger` holds
//! them and they enter through the event admission path.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// `{type: cron, expr, timezone, jitter_seconds | jitter, dst, start_at,
/// end_at, max_runs}`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CronTrigger {
    /// 5 fields (minute first), 6 (seconds first), 7 (with year), or an `@alias`.
    pub expr: String,
    /// IANA zone name; default `UTC`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timezone: Option<String>,
    /// Deterministic per-slot delay in `[0, jitter_seconds)` seconds; default 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub jitter_seconds: u64,
    /// `auto`: a delay fixed per task in `[0, min(period / 10, 15 min))`
    /// (README "Bounds and jitter"); not with `jitter_seconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jitter: Option<JitterMode>,
    /// What a slot in a daylight-saving gap or repeated hour does; default
    /// cronie's rule (README "DST").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dst: Option<DstSpec>,
    /// No slot before this instant (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_at: Option<DateTime<Utc>>,
    /// No slot after this instant (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_at: Option<DateTime<Utc>>,
    /// At most this many runs from this trigger (slots SKIPPED do not count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_runs: Option<u64>,
}

/// `{type: interval, every | every_seconds, start_at, jitter_seconds |
/// jitter, wall_clock, timezone, dst, end_at, max_runs}`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IntervalTrigger {
    /// Period as `"30s"`, `"10m"`, `"2h"`, `"1d"` or combinations (`"1h30m"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every: Option<String>,
    /// Period in whole seconds (alternative to `every`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every_seconds: Option<u64>,
    /// Anchor (RFC 3339) and first slot; slots are `start_at + k*every`,
    /// k ≥ 0. Default: the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_at: Option<DateTime<Utc>>,
    /// Deterministic per-slot delay in `[0, jitter_seconds)` seconds; default 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub jitter_seconds: u64,
    /// `auto`: see [`CronTrigger::jitter`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jitter: Option<JitterMode>,
    /// For a period of whole days: every slot at `start_at`'s local time
    /// in `timezone` (a day is 23 or 25 hours across a change), not every
    /// `every` of elapsed time.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub wall_clock: bool,
    /// The zone of a `wall_clock` interval; default `UTC`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timezone: Option<String>,
    /// A `wall_clock` interval's daylight-saving policy (default: shift, first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dst: Option<DstSpec>,
    /// No slot after this instant (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_at: Option<DateTime<Utc>>,
    /// At most this many runs from this trigger (slots SKIPPED do not count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_runs: Option<u64>,
}

/// `jitter: auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JitterMode {
    /// A bound derived from the period: a tenth, at most 15 minutes.
    Auto,
}

/// `dst: {gap, repeat}`: what a trigger does with local times that a
/// daylight-saving change skips or repeats (temporalio/temporal#8205 asks
/// for the two choices apart). A field left out keeps cronie's rule for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DstSpec {
    /// Slots whose local time never happens (spring forward).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gap: Option<GapRule>,
    /// Slots whose local time happens twice (fall back).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeat: Option<RepeatRule>,
}

/// `dst.gap`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GapRule {
    /// Run at the first instant after the jump (cronie's rule for
    /// fixed-time expressions); slots that land there are one run.
    Shift,
    /// Do not run; the slot leaves a SKIPPED `dst_gap` record at the jump.
    Skip,
}

/// `dst.repeat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RepeatRule {
    /// Only the first occurrence (cronie's rule for fixed-time expressions).
    First,
    /// Only the second occurrence.
    Last,
    /// Both occurrences, each its own run (cronie's rule for `*` and steps).
    Both,
}

impl GapRule {
    /// As written.
    pub fn as_str(self) -> &'static str {
        match self {
            GapRule::Shift => "shift",
            GapRule::Skip => "skip",
        }
    }
}

impl RepeatRule {
    /// As written.
    pub fn as_str(self) -> &'static str {
        match self {
            RepeatRule::First => "first",
            RepeatRule::Last => "last",
            RepeatRule::Both => "both",
        }
    }
}

/// `{type: once, at}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OnceTrigger {
    /// The instant (RFC 3339). If already past when the task is first
    /// applied, the task runs once right away.
    pub at: DateTime<Utc>,
}

/// A time trigger, borrowed from wherever the definition keeps it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TimeTrigger<'a> {
    /// A cron trigger.
    Cron(&'a CronTrigger),
    /// An interval trigger.
    Interval(&'a IntervalTrigger),
    /// A one-shot.
    Once(&'a OnceTrigger),
}

impl TimeTrigger<'_> {
    /// Its `jitter_seconds` (0 for `once`).
    pub fn jitter_seconds(&self) -> u64 {
        match self {
            TimeTrigger::Cron(c) => c.jitter_seconds,
            TimeTrigger::Interval(i) => i.jitter_seconds,
            TimeTrigger::Once(_) => 0,
        }
    }
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}
