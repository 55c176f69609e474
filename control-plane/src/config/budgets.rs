//! `budgets:` — limits on what a set of tasks may spend over a window
//! (cost, tokens, runs), and `prices:` per model, for agents that report
//! tokens and a model but no cost.
//!
//! ```yaml
//! budgets:
//!   - name: team-llm
//!     scope: {agent: brief_agent}     # or {task: ID}, or {label: {team: data}} (the task's labels)
//!     window: 1d                      # 1h | 1d | 30d | month, aligned in `timezone`
//!     timezone: Asia/Shanghai         # default UTC
//!     limits: {cost: 5.0, input_tokens: 1000000, output_tokens: 200000, runs: 100}
//!     soft_percent: 80                # one on_budget notification per window past it
//!     on_exceeded: skip               # skip (SKIPPED budget_exceeded) | pause (the task)
//!     notify: [webhook://alert]       # on_budget sinks
//! prices:
//!   gpt-4o: {input_per_1k: 0.0025, output_per_1k: 0.01}
//! ```
//!
//! Windows are calendar-aligned in the budget's zone: `1h` from the top of
//! each local hour, `1d` from local midnight, `30d` in 30-day blocks
//! counted from 1970-01-01 local, `month` from the first of the month.

use std::collections::BTreeMap;
use std::str::FromStr;

use chrono::{DateTime, Datelike, Duration, NaiveDate, NaiveDateTime, TimeZone, Timelike, Utc};
use chrono_tz::Tz;
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::notify::NotifyConfig;

/// One budget as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetSpec {
    /// Unique name (letters, digits, `_ - .`; 1 to 64).
    pub name: String,
    /// Which runs count: `{task: ID}`, `{agent: ID}` or `{label: {k: v}}`.
    pub scope: ScopeSpec,
    /// `1h`, `1d`, `30d` or `month`.
    pub window: String,
    /// IANA zone of the window boundaries (default UTC).
    #[serde(default)]
    pub timezone: Option<String>,
    /// The hard limits (at least one).
    pub limits: LimitsSpec,
    /// Percent of a limit past which one `on_budget` notification goes out
    /// per window (`1..=100`, default 80).
    #[serde(default = "default_soft")]
    pub soft_percent: u32,
    /// What a run over a hard limit does: `skip` (default) or `pause`.
    #[serde(default)]
    pub on_exceeded: OnExceeded,
    /// `on_budget` sinks (`webhook://NAME` or URLs).
    #[serde(default)]
    pub notify: Vec<String>,
}

fn default_soft() -> u32 {
    80
}

/// `scope:` of a budget, exactly one key.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScopeSpec {
    /// One task.
    #[serde(default)]
    pub task: Option<String>,
    /// Every task of one agent.
    #[serde(default)]
    pub agent: Option<String>,
    /// Every task whose `labels` include all of these.
    #[serde(default)]
    pub label: Option<BTreeMap<String, String>>,
}

/// `limits:` of a budget.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LimitsSpec {
    /// Cost, in the agents' currency unit.
    #[serde(default)]
    pub cost: Option<f64>,
    /// Input tokens.
    #[serde(default)]
    pub input_tokens: Option<u64>,
    /// Output tokens.
    #[serde(default)]
    pub output_tokens: Option<u64>,
    /// Runs admitted.
    #[serde(default)]
    pub runs: Option<u64>,
}

/// What a run over a hard limit does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnExceeded {
    /// A SKIPPED `budget_exceeded` record.
    #[default]
    Skip,
    /// The task is paused (and its slot SKIPPED `budget_exceeded`).
    Pause,
}

/// A validated budget's scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BudgetScope {
    /// One task.
    Task(String),
    /// Every task of one agent.
    Agent(String),
    /// Every task with all these labels.
    Label(BTreeMap<String, String>),
}

impl BudgetScope {
    /// Whether a task (id, agent, labels) is in scope.
    pub fn covers(&self, task_id: &str, agent_id: &str, labels: &BTreeMap<String, String>) -> bool {
        match self {
            BudgetScope::Task(t) => t == task_id,
            BudgetScope::Agent(a) => a == agent_id,
            BudgetScope::Label(want) => want.iter().all(|(k, v)| labels.get(k) == Some(v)),
        }
    }
}

/// A budget's window length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetWindow {
    /// From the top of each local hour.
    Hour,
    /// From local midnight.
    Day,
    /// 30-day blocks from 1970-01-01 local.
    ThirtyDays,
    /// Calendar months.
    Month,
}

/// A validated budget.
#[derive(Debug, Clone)]
pub struct BudgetDef {
    /// Name.
    pub name: String,
    /// Which runs count.
    pub scope: BudgetScope,
    /// Window length.
    pub window: BudgetWindow,
    /// Zone of the window boundaries.
    pub tz: Tz,
    /// Hard limits.
    pub limits: LimitsSpec,
    /// Soft limit, percent.
    pub soft_percent: u32,
    /// Over a hard limit.
    pub on_exceeded: OnExceeded,
    /// `on_budget` sinks.
    pub notify: Vec<String>,
}

impl BudgetDef {
    /// The window holding `t`: `[start, end)`.
    pub fn window_of(&self, t: DateTime<Utc>) -> (DateTime<Utc>, DateTime<Utc>) {
        let local = t.with_timezone(&self.tz).naive_local();
        let start = match self.window {
            BudgetWindow::Hour => local.date().and_hms_opt(local.hour(), 0, 0),
            BudgetWindow::Day => local.date().and_hms_opt(0, 0, 0),
            BudgetWindow::ThirtyDays => {
                let epoch = NaiveDate::from_ymd_opt(1970, 1, 1).unwrap_or_default();
                let days = (local.date() - epoch).num_days().div_euclid(30) * 30;
                (epoch + Duration::days(days)).and_hms_opt(0, 0, 0)
            }
            BudgetWindow::Month => NaiveDate::from_ymd_opt(local.year(), local.month(), 1).and_then(|d| d.and_hms_opt(0, 0, 0)),
        }
        .unwrap_or(local);
        let next = match self.window {
            BudgetWindow::Hour => start + Duration::hours(1),
            BudgetWindow::Day => start + Duration::days(1),
            BudgetWindow::ThirtyDays => start + Duration::days(30),
            BudgetWindow::Month => {
                let (y, m) = if start.month() == 12 { (start.year() + 1, 1) } else { (start.year(), start.month() + 1) };
                NaiveDate::from_ymd_opt(y, m, 1).and_then(|d| d.and_hms_opt(0, 0, 0)).unwrap_or(start + Duration::days(31))
            }
        };
        (self.instant(start), self.instant(next))
    }

    /// The instant of a local wall clock boundary (a boundary in a DST gap
    /// is the first instant after it; in an overlap, the first one).
    fn instant(&self, wall: NaiveDateTime) -> DateTime<Utc> {
        let mut w = wall;
        for _ in 0..180 {
            if let Some(t) = self.tz.from_local_datetime(&w).earliest() {
                return t.with_timezone(&Utc);
            }
            w += Duration::minutes(1);
        }
        Utc.from_utc_datetime(&wall)
    }
}

/// A model's price.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PriceSpec {
    /// Per 1,000 input tokens.
    #[serde(default)]
    pub input_per_1k: f64,
    /// Per 1,000 output tokens.
    #[serde(default)]
    pub output_per_1k: f64,
    /// Per 1,000 input tokens read from a cache (default: the input price).
    #[serde(default)]
    pub cache_read_per_1k: Option<f64>,
}

/// A validated price.
pub type Price = PriceSpec;

impl PriceSpec {
    /// The cost of a usage report.
    pub fn cost(&self, u: &crate::model::run::Usage) -> f64 {
        let fresh = u.input_tokens.saturating_sub(u.cache_read_input_tokens) as f64;
        let cached = u.cache_read_input_tokens as f64;
        (fresh * self.input_per_1k
            + cached * self.cache_read_per_1k.unwrap_or(self.input_per_1k)
            + u.output_tokens as f64 * self.output_per_1k)
            / 1000.0
    }
}

/// Checks one price.
///
/// Errors: `InvalidArgument` naming `prices.MODEL.FIELD`.
pub fn validate_price(model: &str, p: &PriceSpec) -> Result<Price> {
    for (f, v) in
        [("input_per_1k", Some(p.input_per_1k)), ("output_per_1k", Some(p.output_per_1k)), ("cache_read_per_1k", p.cache_read_per_1k)]
    {
        if let Some(v) = v
            && (!v.is_finite() || v < 0.0)
        {
            return Err(Error::invalid(format!("prices.{model}.{f}"), "must be a number >= 0"));
        }
    }
    Ok(*p)
}

/// Checks the `i`-th budget; its `notify` sinks against the config's.
///
/// Errors: `InvalidArgument` naming `budgets[i].FIELD`.
pub fn validate(i: usize, b: &BudgetSpec, notify: &NotifyConfig) -> Result<BudgetDef> {
    let field = |f: &str| format!("budgets[{i}].{f}");
    if b.name.is_empty() || b.name.len() > 64 || !b.name.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c)) {
        return Err(Error::invalid(field("name"), "1 to 64 letters, digits, _ - ."));
    }
    let scope = match (&b.scope.task, &b.scope.agent, &b.scope.label) {
        (Some(t), None, None) => BudgetScope::Task(t.clone()),
        (None, Some(a), None) => BudgetScope::Agent(a.clone()),
        (None, None, Some(l)) if !l.is_empty() => BudgetScope::Label(l.clone()),
        _ => return Err(Error::invalid(field("scope"), "give exactly one of task, agent or label (a non-empty map)")),
    };
    // A scope no task can be in would never apply: refused, as a task's
    // own ids and labels are.
    match &scope {
        BudgetScope::Task(t) => crate::model::task::validate_id(&field("scope.task"), t)?,
        BudgetScope::Agent(a) => crate::model::task::validate_id(&field("scope.agent"), a)?,
        BudgetScope::Label(l) => {
            if let Some((k, _)) = l.iter().find(|(k, v)| !crate::model::task::label_ok(k) || !crate::model::task::label_ok(v)) {
                return Err(Error::invalid(field(&format!("scope.label.{k}")), "keys and values are 1 to 63 letters, digits, _ - ."));
            }
        }
    }
    let window = match b.window.as_str() {
        "1h" => BudgetWindow::Hour,
        "1d" => BudgetWindow::Day,
        "30d" => BudgetWindow::ThirtyDays,
        "month" => BudgetWindow::Month,
        other => return Err(Error::invalid(field("window"), format!("{other:?}: use 1h, 1d, 30d or month"))),
    };
    let tz = match &b.timezone {
        None => Tz::UTC,
        Some(z) => Tz::from_str(z).map_err(|_| Error::invalid(field("timezone"), format!("unknown time zone {z:?}")))?,
    };
    let l = &b.limits;
    if l.cost.is_none() && l.input_tokens.is_none() && l.output_tokens.is_none() && l.runs.is_none() {
        return Err(Error::invalid(field("limits"), "give at least one of cost, input_tokens, output_tokens, runs"));
    }
    if let Some(c) = l.cost
        && (!c.is_finite() || c < 0.0)
    {
        return Err(Error::invalid(field("limits.cost"), "must be a number >= 0"));
    }
    if !(1..=100).contains(&b.soft_percent) {
        return Err(Error::invalid(field("soft_percent"), "must be in 1..=100"));
    }
    for (j, s) in b.notify.iter().enumerate() {
        match s.strip_prefix("webhook://") {
            Some(name) if !notify.has_sink(name) => {
                return Err(Error::invalid(format!("budgets[{i}].notify[{j}]"), format!("webhook://{name} is not a sink of this file")));
            }
            Some(_) => {}
            None if s.starts_with("http://") || s.starts_with("https://") => {}
            None => return Err(Error::invalid(format!("budgets[{i}].notify[{j}]"), "an http(s):// URL or webhook://NAME")),
        }
    }
    Ok(BudgetDef {
        name: b.name.clone(),
        scope,
        window,
        tz,
        limits: b.limits,
        soft_percent: b.soft_percent,
        on_exceeded: b.on_exceeded,
        notify: b.notify.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(window: &str, tz: &str) -> BudgetDef {
        let spec = BudgetSpec {
            name: "b".into(),
            scope: ScopeSpec { task: Some("t".into()), ..Default::default() },
            window: window.into(),
            timezone: Some(tz.into()),
            limits: LimitsSpec { runs: Some(10), ..Default::default() },
            soft_percent: 80,
            on_exceeded: OnExceeded::Skip,
            notify: Vec::new(),
        };
        validate(0, &spec, &NotifyConfig::default()).expect("valid")
    }

    fn t(s: &str) -> DateTime<Utc> {
        s.parse().expect("t")
    }

    #[test]
    fn windows_are_aligned_in_the_zone() {
        assert_eq!(def("1h", "UTC").window_of(t("2026-12-02T10:20:00Z")), (t("2026-12-02T10:00:00Z"), t("2026-12-02T11:00:00Z")));
        // Shanghai's day starts at 16:00Z the day before.
        assert_eq!(def("1d", "Asia/Shanghai").window_of(t("2026-12-02T10:20:00Z")), (t("2026-12-01T16:00:00Z"), t("2026-12-02T16:00:00Z")));
        assert_eq!(def("month", "UTC").window_of(t("2026-12-31T23:59:00Z")), (t("2026-12-01T00:00:00Z"), t("2027-01-01T00:00:00Z")));
        let (s, e) = def("30d", "UTC").window_of(t("2026-12-02T10:00:00Z"));
        assert_eq!(e - s, Duration::days(30));
        assert!(s <= t("2026-12-02T10:00:00Z") && t("2026-12-02T10:00:00Z") < e);
        // A day across the spring-forward change is 23 hours long.
        let (s, e) = def("1d", "America/New_York").window_of(t("2026-03-08T12:00:00Z"));
        assert_eq!(e - s, Duration::hours(23));
    }

    #[test]
    fn bad_budgets_name_the_field() {
        let mut spec = BudgetSpec {
            name: "b".into(),
            scope: ScopeSpec::default(),
            window: "1d".into(),
            timezone: None,
            limits: LimitsSpec::default(),
            soft_percent: 80,
            on_exceeded: OnExceeded::Skip,
            notify: vec!["webhook://nope".into()],
        };
        let n = NotifyConfig::default();
        assert!(validate(0, &spec, &n).expect_err("scope").to_string().starts_with("budgets[0].scope"));
        spec.scope.task = Some(String::new());
        assert!(validate(0, &spec, &n).expect_err("task").to_string().starts_with("budgets[0].scope.task"));
        spec.scope.task = None;
        spec.scope.label = Some([("bad key!".to_string(), String::new())].into());
        assert!(validate(0, &spec, &n).expect_err("label").to_string().starts_with("budgets[0].scope.label.bad key!"));
        spec.scope.label = None;
        spec.scope.agent = Some("a".into());
        assert!(validate(0, &spec, &n).expect_err("limits").to_string().starts_with("budgets[0].limits"));
        spec.limits.cost = Some(1.0);
        assert!(validate(0, &spec, &n).expect_err("sink").to_string().starts_with("budgets[0].notify[0]"));
        spec.notify.clear();
        spec.window = "1w".into();
        assert!(validate(0, &spec, &n).expect_err("window").to_string().starts_with("budgets[0].window"));
    }
}
