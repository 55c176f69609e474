//! Views: what a person or a client reads of the scheduler, in one place.
//!
//! Every list or status screen — `ListRunners`, `ListResources`,
//! `ListBudgets`, `ListTasks` with its recent slots, `GetClusterStatus`,
//! and next the dashboard — renders one of these types; none reads the
//! store or the engine on its own. Where a view's data lives decides who
//! builds it:
//! - the leader's live state (runners, resources, budgets): the engine core
//!   answers one [`crate::engine::EngineHandle::query`], and each policy
//!   gives its part through [`crate::engine::core::policy::Policy::snapshot`]
//!   (quinn's `Controller::metrics()` is the model: introspection lives in
//!   the seam that holds the state);
//! - the store and the history (tasks, runs, slots): [`crate::api::Core`]
//!   reads them once and builds the view.
//!
//! Adding a view: its type here, the query (a core method or an `api`
//! read) that fills it, and its renderers (`service/` for gRPC, the CLI's
//! output, the dashboard's template).
//!
//! Views are plain data: no I/O, no locks; times are UTC.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::config::ResourceLimits;
use crate::config::budgets::LimitsSpec;
use crate::model::budget::Amount;
use crate::model::run::TriggerKind;
use crate::model::{RunRecord, RunStatus};

/// Most recent slots one task summary carries ([`TaskSummary::slots`]).
pub const MAX_SLOT_CELLS: u32 = 50;

// ------------------------------------------------------------------ runs

/// One run in a line: what a runs table or a slot cell shows. Built from a
/// [`RunRecord`] by [`RunSummary::of`]; lags in milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    /// Run id.
    pub run_id: String,
    /// Task id.
    pub task_id: String,
    /// Status now.
    pub status: RunStatus,
    /// What made it.
    pub trigger: TriggerKind,
    /// Its slot (UTC).
    pub scheduled_at: DateTime<Utc>,
    /// The agent began (first attempt's start), if it did.
    pub started_at: Option<DateTime<Utc>>,
    /// It ended, if it did.
    pub finished_at: Option<DateTime<Utc>>,
    /// Slot → first dispatch, ms.
    pub dispatch_lag_ms: Option<i64>,
    /// Slot → the agent began, ms.
    pub start_lag_ms: Option<i64>,
    /// Start → end, ms.
    pub duration_ms: Option<i64>,
    /// Attempts made (elided ones counted).
    pub attempts: u32,
    /// The runner of the last attempt (empty: none).
    pub runner_id: String,
    /// Slots this one record stands for: 1, or a coalesced missed range's
    /// count (`missed_count`).
    pub slots: u64,
    /// Why, in words, when the status alone does not say: the skip reason
    /// of a SKIPPED run, the pending reason of a waiting one, the error of
    /// a failed one (empty otherwise).
    pub reason: String,
}

impl RunSummary {
    /// The summary of `r`.
    pub fn of(r: &RunRecord) -> RunSummary {
        let ms = |a: DateTime<Utc>, b: Option<DateTime<Utc>>| b.map(|b| (b - a).num_milliseconds());
        let reason = match r.status {
            RunStatus::Skipped => r.skip_reason.map(|s| s.as_str().to_string()).unwrap_or_default(),
            RunStatus::Pending | RunStatus::Retrying => r.pending_reason.clone().unwrap_or_default(),
            RunStatus::Failed | RunStatus::Timeout | RunStatus::Cancelled => r.error.clone().unwrap_or_default(),
            RunStatus::Running | RunStatus::Succeeded => String::new(),
        };
        RunSummary {
            run_id: r.run_id.clone(),
            task_id: r.task_id.clone(),
            status: r.status,
            trigger: r.trigger,
            scheduled_at: r.scheduled_at,
            started_at: r.actual_started_at,
            finished_at: r.finished_at,
            dispatch_lag_ms: ms(r.due_at(), r.dispatched_at),
            start_lag_ms: ms(r.due_at(), r.actual_started_at),
            duration_ms: r.actual_started_at.and_then(|s| ms(s, r.finished_at)),
            attempts: r.counted_attempts(),
            runner_id: r.attempts.last().map(|a| a.runner_id.clone()).unwrap_or_default(),
            slots: r.missed_count.unwrap_or(0).max(1),
            reason,
        }
    }
}

/// One run whole: its record as stored (or as the leader holds it, when it
/// is live and ahead of the store) with its summary.
#[derive(Debug, Clone)]
pub struct RunDetail {
    /// The derived line.
    pub summary: RunSummary,
    /// The record.
    pub record: RunRecord,
}

impl RunDetail {
    /// The detail of `record`.
    pub fn of(record: RunRecord) -> RunDetail {
        RunDetail { summary: RunSummary::of(&record), record }
    }
}

/// One slot of a task as a cell: newest first in [`TaskSummary::slots`].
/// A coalesced missed range is one cell with `summary.slots` > 1.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotCell {
    /// The run that stands for the slot.
    pub summary: RunSummary,
}

impl SlotCell {
    /// The cell's text: its status, and its reason where it has one
    /// (`SKIPPED concurrency_limit`, `SKIPPED misfired ×12`): what a screen
    /// reader, a test or a terminal shows.
    pub fn label(&self) -> String {
        let s = &self.summary;
        let mut t = s.status.as_str().to_string();
        if !s.reason.is_empty() && s.status == RunStatus::Skipped {
            t.push(' ');
            t.push_str(&s.reason);
        }
        if s.slots > 1 {
            t.push_str(&format!(" ×{}", s.slots));
        }
        t
    }
}

/// A task in a list: its definition and scheduler state
/// ([`crate::api::TaskView`]) and its most recent slots, newest first.
#[derive(Debug, Clone)]
pub struct TaskSummary {
    /// The task as stored, with its cursor and next fire.
    pub task: crate::api::TaskView,
    /// Its last slots, newest first (at most the number asked for, at most
    /// [`MAX_SLOT_CELLS`]).
    pub slots: Vec<SlotCell>,
}

/// Which tasks a list shows ([`crate::api::Core::task_summaries`]): all
/// when default.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TaskFilter {
    /// A substring (case-insensitive) of the task id, its agent, or one of
    /// its labels (`key=value`); empty: any.
    pub text: String,
    /// Only paused (`Some(true)`) or running (`Some(false)`) tasks.
    pub paused: Option<bool>,
    /// Only tasks with a trigger of this kind.
    pub trigger: Option<TriggerKind>,
    /// Only tasks whose breaker is open (or half-open).
    pub breaker_open: bool,
    /// Only tasks whose newest run has this status (needs its slots read).
    pub last_status: Option<RunStatus>,
}

impl TaskFilter {
    /// Whether the filter reads nothing but the definition and cursor
    /// (every condition but `last_status`).
    pub fn is_empty(&self) -> bool {
        *self == TaskFilter::default()
    }

    /// A test on a task's stored bytes (its JSON) that every task the text
    /// search admits passes: each `=`-separated piece of the text occurs in
    /// them, ASCII case aside. Ids, agents and label keys and values are
    /// ASCII letters, digits and `_ - .` ([`crate::model::task::validate_id`],
    /// [`crate::model::task::label_ok`]), written in JSON as they are, so
    /// this holds for an ASCII text; a text with other characters (Unicode
    /// case folding can turn one into an ASCII letter) passes every record
    /// to be decoded. [`TaskFilter::admits`] still decides.
    pub fn raw_test(&self) -> impl Fn(&[u8]) -> bool + use<> {
        let pieces: Vec<memchr::memmem::Finder<'static>> = if self.text.is_ascii() {
            self.text
                .to_ascii_lowercase()
                .split('=')
                .filter(|p| !p.is_empty())
                .map(|p| memchr::memmem::Finder::new(p.as_bytes()).into_owned())
                .collect()
        } else {
            Vec::new()
        };
        move |raw: &[u8]| {
            if pieces.is_empty() {
                return true;
            }
            let lower = raw.to_ascii_lowercase();
            pieces.iter().all(|f| f.find(&lower).is_some())
        }
    }

    /// Whether `t` passes every condition that its definition and cursor
    /// decide (all but `last_status`).
    pub fn admits(&self, t: &crate::api::TaskView) -> bool {
        let spec = &t.record.spec;
        if let Some(p) = self.paused
            && t.record.paused != p
        {
            return false;
        }
        if let Some(k) = self.trigger
            && !spec.all_triggers().iter().any(|tr| tr.kind() == k)
        {
            return false;
        }
        if self.breaker_open
            && !t.cursor.as_ref().and_then(|c| c.breaker.as_ref()).is_some_and(|b| b.phase != crate::model::breaker::BreakerPhase::Closed)
        {
            return false;
        }
        if self.text.is_empty() {
            return true;
        }
        let needle = self.text.to_lowercase();
        let has = |s: &str| s.to_lowercase().contains(&needle);
        has(&spec.task_id) || has(&spec.agent_id) || spec.labels.iter().any(|(k, v)| has(&format!("{k}={v}")))
    }
}

// ------------------------------------------------------- the leader's state

/// A runner as `ClusterService.ListRunners` shows it.
#[derive(Debug, Clone)]
pub struct RunnerView {
    /// Id.
    pub runner_id: String,
    /// Agents served.
    pub agents: Vec<String>,
    /// Slots.
    pub slots: u32,
    /// Busy slots (open attempts and agents not yet confirmed gone).
    pub busy: u32,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Version.
    pub version: String,
    /// Its stream is open.
    pub connected: bool,
    /// Stream opened (UTC).
    pub connected_at: DateTime<Utc>,
    /// Last message (UTC).
    pub last_seen: DateTime<Utc>,
    /// Run ids holding its slots.
    pub running: Vec<String>,
    /// It said it is draining (stopping): no new run is placed on it.
    pub draining: bool,
}

/// A resource as `punchclock resources list` and `/metrics` show it.
#[derive(Debug, Clone, PartialEq)]
pub struct ResourceView {
    /// Name.
    pub name: String,
    /// Limits.
    pub limits: ResourceLimits,
    /// Concurrency units held by live agents.
    pub in_use: u32,
    /// Runs waiting for it now.
    pub waiting: u32,
    /// Requests that could start now (rounded down), if it has a request rate.
    pub requests_available: Option<f64>,
    /// Tokens that could be reserved now, if it has a token rate.
    pub tokens_available: Option<f64>,
    /// Held back until (UTC), and why.
    pub held_until: Option<DateTime<Utc>>,
    /// Why it is held back.
    pub held_why: String,
}

/// A budget's current window as `budgets list` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetView {
    /// Name.
    pub name: String,
    /// `task ID`, `agent ID` or `label k=v,...`.
    pub scope: String,
    /// The scope as a rule: [`BudgetView::covers`].
    pub scope_rule: crate::config::budgets::BudgetScope,
    /// `1h`, `1d`, `30d` or `month`.
    pub window: &'static str,
    /// The current window: `[start, end)`; `end` is when it resets.
    pub window_start: DateTime<Utc>,
    /// When it resets.
    pub window_end: DateTime<Utc>,
    /// Settled spend in it.
    pub used: Amount,
    /// Reserved by runs admitted and not yet ended.
    pub reserved: Amount,
    /// The hard limits (`None`: that measure is not limited).
    pub limits: LimitsSpec,
    /// Soft limit, percent.
    pub soft_percent: u32,
    /// `skip` or `pause`.
    pub on_exceeded: &'static str,
    /// `ok`, `soft` (past the soft limit) or `exceeded` (a hard limit
    /// reached, or the window's last admission refused: its runs are
    /// SKIPPED `budget_exceeded`).
    pub state: &'static str,
    /// The budget's zone (IANA): its windows are calendar windows there.
    pub timezone: String,
}

impl BudgetView {
    /// Whether a task (id, agent, labels) is in the budget's scope.
    pub fn covers(&self, task_id: &str, agent_id: &str, labels: &BTreeMap<String, String>) -> bool {
        self.scope_rule.covers(task_id, agent_id, labels)
    }

    /// Each limited measure as `used / limit` with its unit (`cost
    /// 0.1200 / 5.0000`, `runs 3 / 10`, `input tokens …`), reserved spend
    /// counted as used; `no limit` when none is set.
    pub fn use_words(&self) -> Vec<String> {
        let u = self.used.plus(self.reserved);
        let mut out = Vec::new();
        if let Some(l) = self.limits.cost {
            out.push(format!("cost {:.4} / {l:.4}", u.cost));
        }
        let counts = [
            ("runs", u.runs, self.limits.runs),
            ("input tokens", u.input_tokens, self.limits.input_tokens),
            ("output tokens", u.output_tokens, self.limits.output_tokens),
        ];
        for (what, used, limit) in counts {
            if let Some(l) = limit {
                out.push(format!("{what} {used} / {l}"));
            }
        }
        if out.is_empty() {
            out.push("no limit".into());
        }
        out
    }
}

/// What each policy shows of its state: filled by
/// [`crate::engine::core::policy::Policy::snapshot`], one part each.
#[derive(Debug, Clone, Default)]
pub struct PolicyViews {
    /// Shared resources (the resources policy), by name.
    pub resources: Vec<ResourceView>,
    /// Budgets' current windows (the budgets policy), in config order.
    pub budgets: Vec<BudgetView>,
}

// ---------------------------------------------------------------- cluster

/// A control-plane replica.
#[derive(Debug, Clone, PartialEq)]
pub struct MemberView {
    /// Replica id.
    pub id: String,
    /// Its gRPC address.
    pub advertise_address: String,
    /// It leads.
    pub is_leader: bool,
}

/// The cluster as one replica sees it (`GetClusterStatus`, the dashboard's
/// header).
#[derive(Debug, Clone)]
pub struct ClusterView {
    /// Replicas, by id.
    pub members: Vec<MemberView>,
    /// The leader's id (empty: none known).
    pub leader_id: String,
    /// The leader's gRPC address.
    pub leader_address: String,
    /// The leader's fencing token.
    pub fencing_token: u64,
    /// The leader holds its lease but does not answer.
    pub leader_unresponsive: bool,
    /// The store, described (`etcd http://…`, `embedded /path`).
    pub store: String,
    /// The replica that answered.
    pub answered_by: String,
    /// The running cluster config's version.
    pub config_version: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::run::SkipReason;

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
    }

    #[test]
    fn a_summary_derives_lags_and_says_why_a_slot_was_skipped() {
        let r = RunRecord::skipped("r1".into(), "t", "a", TriggerKind::Cron, SkipReason::Misfired, (12, t(0), t(60)), String::new(), t(61));
        let cell = SlotCell { summary: RunSummary::of(&r) };
        assert_eq!(cell.summary.slots, 12);
        assert_eq!(cell.label(), "SKIPPED misfired ×12");

        let mut r = RunRecord::pending("r2".into(), "t", "a", TriggerKind::Cron, t(0), t(0));
        r.dispatched_at = Some(t(1));
        r.actual_started_at = Some(t(2));
        r.finished_at = Some(t(7));
        r.status = RunStatus::Succeeded;
        let s = RunSummary::of(&r);
        assert_eq!((s.dispatch_lag_ms, s.start_lag_ms, s.duration_ms), (Some(1000), Some(2000), Some(5000)));
        assert_eq!((s.slots, s.reason.as_str()), (1, ""));
        assert_eq!(SlotCell { summary: s }.label(), "SUCCEEDED");
    }

    /// The test on stored bytes never turns away a task the search admits
    /// (it would vanish from the list), and turns away most others.
    #[test]
    fn the_raw_test_passes_every_task_the_search_admits() {
        use crate::model::{Definition, TaskRecord};
        let record = |doc: serde_json::Value| {
            let rec = TaskRecord::new(Definition::from_json(&doc.to_string()).expect("valid"), t(0));
            let raw = crate::repo::codec::encode(&rec).expect("encode");
            (crate::api::TaskView { record: rec, cursor: None, next_fire_at: None, ended: None }, raw)
        };
        let tasks = [
            record(serde_json::json!({"task_id": "Daily-Report", "agent_id": "writer", "labels": {"team": "Needle"}})),
            record(serde_json::json!({"task_id": "unicode", "agent_id": "a", "context": {"params": {"note": "Ünïcödé \u{212A}"}}})),
            record(serde_json::json!({"task_id": "eq", "agent_id": "x", "labels": {"a.b": "c-d"}})),
            record(serde_json::json!({"task_id": "other", "agent_id": "plain"})),
        ];
        let texts = [
            "daily",
            "REPORT",
            "team=need",
            "am=ne",
            "needle",
            "q\"u",
            "k",
            "\u{212A}",
            "UNICODE",
            "ÜNI",
            "b=c",
            "b=c-d",
            "a.b=c-d",
            "=",
            "zzz",
            "writer",
            "other",
        ];
        for text in texts {
            let f = TaskFilter { text: text.into(), ..TaskFilter::default() };
            let raw = f.raw_test();
            for (view, bytes) in &tasks {
                if f.admits(view) {
                    assert!(raw(bytes), "{text:?} admits {} but its bytes were turned away", view.record.spec.task_id);
                }
            }
        }
        let f = TaskFilter { text: "zzz".into(), ..TaskFilter::default() };
        assert!(!f.raw_test()(&tasks[0].1), "a text in no record turns an ASCII record away");
        let f = TaskFilter { text: "needle".into(), ..TaskFilter::default() };
        assert!(!f.raw_test()(&tasks[3].1));
    }
}
