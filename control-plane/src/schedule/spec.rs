//! Time triggers as users write them (`{type: cron | interval | once, ...}`
//! in a task's `trigger`/`triggers`): `schedule/` owns them, compiles them
//! ([`super::compile`]) and plans their slots. The other trigger kinds
//! (webhook, queue, event, after) are not time: `model::trigger` holds
//! them and they enter through the event admission path.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// `{type: cron, expr, timezone, jitter_seconds}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
}

/// `{type: interval, every | every_seconds, start_at, jitter_seconds}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IntervalTrigger {
    /// Period as `"30s"`, `"10m"`, `"2h"`, `"1d"` or combinations (`"1h30m"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every: Option<String>,
    /// Period in whole seconds (alternative to `every`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every_seconds: Option<u64>,
    /// Anchor (RFC 3339); slots are `start_at + k*every`. Default: the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_at: Option<DateTime<Utc>>,
    /// Deterministic per-slot delay in `[0, jitter_seconds)` seconds; default 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub jitter_seconds: u64,
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
