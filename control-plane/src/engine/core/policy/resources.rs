//! Cluster-wide resources (`resources:` of the config; a task takes them
//! with `execution.resources`), enforced at dispatch by the one fenced
//! leader, in memory and exactly — no check-then-consume race:
//!
//! - **concurrency**: a permit is held from dispatch until the attempt's
//!   agent is gone (an attempt the control plane ended holds it until its
//!   runner reports the agent gone or the fence deadline passes, as
//!   `concurrency_limit` does). Permits are derived from the attempts in
//!   memory ([`Policy::run_changed`]), so a new leader rebuilds them from
//!   the active runs it loads (each attempt records what it holds).
//! - **rates** (`requests_per_minute`, `tokens_per_minute`) are token
//!   buckets of a minute's capacity. A dispatch takes one request and
//!   reserves the task's token estimate; the attempt's reported usage
//!   settles it when it ends (a refund, or a debt the bucket pays off).
//!   A new leader starts every bucket empty: it counts the last window as
//!   full, so a failover never over-admits.
//! - **hold-backs**: an agent that answered `rate_limited` naming a
//!   resource its task uses holds it back for every task until its
//!   `retry_at`; `quota_exhausted` for `quota_backoff`. A resource the
//!   task does not use is not held (an agent cannot freeze what it has no
//!   part in; the attempt still records what it named). Each hold is
//!   written (`holds/{resource}`) with the attempt's end, so a new leader
//!   loads it ([`Resources::load_holds`]) whatever became of the run;
//!   `punchclock resources release NAME` ends one ([`Resources::release_hold`]).
//! - **busy**: a run that cannot go waits (`on_resource_busy: wait`,
//!   showing `resource NAME (3/3 in use)`), served with every other ready
//!   run by priority then slot (the core's dispatch pass is in that order
//!   across agents); with `skip`, a run whose resource is busy when its
//!   slot is due is a SKIPPED `resource_busy` record — at admission when
//!   it is busy then, else when the run could be dispatched and found it
//!   busy (runs of `wait` tasks due in the same instant went first).

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Duration, Utc};

use super::{Admit, AdmitQuery, AfterAttempt, AttemptQuery, Dispatch, DispatchQuery, Policy, Write};
use crate::config::{Config, ResourceLimits};
use crate::model::RunRecord;
use crate::model::run::{HoldBack, Outcome, ResourceHold, SkipReason};
use crate::model::task::{OnResourceBusy, ResourceUse, TaskSpec};
use crate::repo::StoreOp;
use crate::views::ResourceView;

/// The largest debt a bucket carries, in minutes of its rate: usage
/// reported beyond an estimate is charged up to this much.
pub const MAX_DEBT_MINUTES: f64 = 5.0;

/// A token bucket of one minute's capacity, refilled continuously.
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    /// Capacity: the per-minute limit.
    pub capacity: f64,
    /// Tokens now (negative: a debt from usage beyond the estimate).
    pub level: f64,
    /// When `level` was computed (`None`: not yet used; it starts empty
    /// at its first use).
    pub at: Option<DateTime<Utc>>,
}

impl Bucket {
    /// An empty bucket of `per_minute`, from its first use on (a new
    /// leader's: the last window counted as full).
    pub fn empty(per_minute: f64) -> Bucket {
        Bucket { capacity: per_minute, level: 0.0, at: None }
    }

    fn refill(&mut self, now: DateTime<Utc>) {
        let at = *self.at.get_or_insert(now);
        // A wall clock step back refills nothing.
        let secs = (now - at).num_microseconds().unwrap_or(i64::MAX).max(0) as f64 / 1e6;
        self.level = (self.level + secs * self.capacity / 60.0).min(self.capacity);
        self.at = Some(at.max(now));
    }

    /// What `n` costs: at most the capacity (a bigger estimate waits for a
    /// full bucket, then runs into debt).
    fn need(&self, n: f64) -> f64 {
        n.min(self.capacity)
    }

    /// `None` when `n` can be taken now, else when it can.
    pub fn ready_at(&mut self, n: f64, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.refill(now);
        let need = self.need(n);
        if self.level >= need {
            return None;
        }
        let secs = ((need - self.level) * 60.0 / self.capacity).min(MAX_DEBT_MINUTES * 60.0 + 60.0);
        Some(now + Duration::milliseconds((secs * 1000.0).ceil() as i64))
    }

    /// Takes `n` (call after [`Bucket::ready_at`] said now): the level may
    /// go below zero by what exceeds the capacity.
    pub fn take(&mut self, n: f64, now: DateTime<Utc>) {
        self.refill(now);
        self.level -= n;
    }

    /// Gives back `n` (negative: charges more), never above the capacity
    /// nor below [`MAX_DEBT_MINUTES`] of it (usage far past any estimate
    /// holds the resource back a few minutes, not for ever).
    pub fn settle(&mut self, n: f64, now: DateTime<Utc>) {
        self.refill(now);
        self.level = (self.level + n).clamp(-self.capacity * MAX_DEBT_MINUTES, self.capacity);
    }
}

/// One resource's live state.
#[derive(Debug, Clone)]
pub struct ResourceState {
    /// Its limits.
    pub limits: ResourceLimits,
    /// Concurrency units held by live agents.
    pub in_use: u32,
    /// Attempts started, per minute.
    pub requests: Option<Bucket>,
    /// Tokens, per minute.
    pub tokens: Option<Bucket>,
    /// Held back until (UTC), and why.
    pub held: Option<(DateTime<Utc>, String)>,
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct Resources {
    state: BTreeMap<String, ResourceState>,
    /// What each live attempt holds (by execution id).
    holders: HashMap<String, Vec<ResourceHold>>,
    /// Attempts dispatched in this term: their token reservations are in
    /// this term's buckets (an older one's are not, and get no refund).
    reserved_here: HashSet<String>,
    /// Runs of `on_resource_busy: skip` tasks admitted and not yet
    /// dispatched: they count as using the resource for the next
    /// admission of such a run.
    promised: HashMap<String, Vec<(String, u32)>>,
    /// Runs waiting for a resource: which, since when.
    waiting: HashMap<String, (String, DateTime<Utc>)>,
    /// Waits that ended in a dispatch, for the wait-time histogram:
    /// `(resource, seconds)`, drained by the core.
    waited: Vec<(String, f64)>,
    quota_backoff: Duration,
}

impl Resources {
    /// Every resource now.
    pub fn views(&self, now: DateTime<Utc>) -> Vec<ResourceView> {
        let mut waiting: HashMap<&str, u32> = HashMap::new();
        for (name, _) in self.waiting.values() {
            *waiting.entry(name.as_str()).or_default() += 1;
        }
        self.state
            .iter()
            .map(|(name, s)| {
                let avail = |b: &Option<Bucket>| {
                    b.clone().map(|mut b| {
                        b.refill(now);
                        b.level.max(0.0).floor()
                    })
                };
                let held = s.held.clone().filter(|(t, _)| *t > now);
                ResourceView {
                    name: name.clone(),
                    limits: s.limits,
                    in_use: s.in_use,
                    waiting: waiting.get(name.as_str()).copied().unwrap_or(0),
                    requests_available: avail(&s.requests),
                    tokens_available: avail(&s.tokens),
                    held_until: held.as_ref().map(|(t, _)| *t),
                    held_why: held.map(|(_, w)| w).unwrap_or_default(),
                }
            })
            .collect()
    }

    /// The waits that ended in a dispatch since the last call.
    pub fn take_waited(&mut self) -> Vec<(String, f64)> {
        std::mem::take(&mut self.waited)
    }

    /// Why `uses` cannot all be taken now (`None`: they can), and until
    /// when at the earliest if known. `extra`: units promised to runs
    /// admitted but not yet dispatched (for a `skip` admission).
    fn busy(&mut self, uses: &[ResourceUse], now: DateTime<Utc>, extra: bool) -> Option<(String, String, Option<DateTime<Utc>>)> {
        let mut promised: HashMap<&str, u32> = HashMap::new();
        if extra {
            for (name, units) in self.promised.values().flatten() {
                *promised.entry(name.as_str()).or_default() += units;
            }
        }
        for u in uses {
            let Some(s) = self.state.get_mut(&u.name) else {
                return Some((u.name.clone(), format!("resource {} is not defined in this leader's config", u.name), None));
            };
            if let Some((until, why)) = s.held.as_ref().filter(|(t, _)| *t > now) {
                let when = until.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
                return Some((u.name.clone(), format!("resource {} held back until {when}: {why}", u.name), Some(*until)));
            }
            if let Some(limit) = s.limits.concurrency {
                let used = s.in_use + promised.get(u.name.as_str()).copied().unwrap_or(0);
                if used + u.units > limit {
                    return Some((u.name.clone(), format!("resource {} ({used}/{limit} in use)", u.name), None));
                }
            }
            if let Some(at) = s.requests.as_mut().and_then(|b| b.ready_at(1.0, now)) {
                let limit = s.limits.requests_per_minute.unwrap_or_default();
                return Some((u.name.clone(), format!("resource {} at requests_per_minute {limit}", u.name), Some(at)));
            }
            if u.tokens > 0
                && let Some(at) = s.tokens.as_mut().and_then(|b| b.ready_at(u.tokens as f64, now))
            {
                let limit = s.limits.tokens_per_minute.unwrap_or_default();
                return Some((u.name.clone(), format!("resource {} at tokens_per_minute {limit}", u.name), Some(at)));
            }
        }
        None
    }

    /// Holds `name` back until `until` unless it is held longer already;
    /// true when the hold moved.
    fn hold(&mut self, name: &str, until: DateTime<Utc>, why: String) -> bool {
        let Some(s) = self.state.get_mut(name) else { return false };
        if s.held.as_ref().is_none_or(|(t, _)| *t < until) {
            tracing::info!(resource = name, until = %until, why = %why, "resource held back");
            s.held = Some((until, why));
            return true;
        }
        false
    }

    /// The hold-backs a new leader read from the store (`holds/`): each
    /// that has not ended and names a resource of the config is held again.
    pub fn load_holds(&mut self, holds: Vec<(String, HoldBack)>, now: DateTime<Utc>) {
        for (name, h) in holds {
            if h.until > now {
                self.hold(&name, h.until, h.why);
            }
        }
    }

    /// `punchclock resources release NAME`: ends the resource's hold-back
    /// now. Returns whether it was held.
    ///
    /// Errors: `NotFound` for a resource the config does not define.
    pub fn release_hold(&mut self, name: &str, now: DateTime<Utc>) -> crate::error::Result<bool> {
        let s = self.state.get_mut(name).ok_or_else(|| crate::error::Error::NotFound { kind: "resource", id: name.to_string() })?;
        let held = s.held.take().is_some_and(|(t, _)| t > now);
        if held {
            tracing::info!(resource = name, "resource hold-back released by hand");
        }
        Ok(held)
    }

    fn release(&mut self, execution_id: &str) {
        if let Some(holds) = self.holders.remove(execution_id) {
            for h in holds {
                if let Some(s) = self.state.get_mut(&h.name) {
                    s.in_use = s.in_use.saturating_sub(h.units);
                }
            }
        }
    }

    fn uses(task: &TaskSpec) -> &[ResourceUse] {
        &task.execution.resources
    }
}

impl Policy for Resources {
    fn name(&self) -> &'static str {
        "resources"
    }

    fn snapshot(&self, now: DateTime<Utc>, into: &mut crate::views::PolicyViews) {
        into.resources = self.views(now);
    }

    fn configure(&mut self, config: &Config) {
        self.quota_backoff = Duration::from_std(config.quota_backoff).unwrap_or(Duration::minutes(15));
        let mut next = BTreeMap::new();
        for (name, limits) in &config.resources {
            let old = self.state.remove(name);
            let bucket = |per_minute: Option<f64>, old: Option<Bucket>| {
                per_minute.map(|pm| match old {
                    // A reload keeps what was taken, within the new capacity.
                    Some(b) => Bucket { capacity: pm, level: b.level.min(pm), at: b.at },
                    None => Bucket::empty(pm),
                })
            };
            let in_use = old.as_ref().map_or(0, |o| o.in_use);
            let held = old.as_ref().and_then(|o| o.held.clone());
            let requests = bucket(limits.requests_per_minute.map(f64::from), old.as_ref().and_then(|o| o.requests.clone()));
            let tokens = bucket(limits.tokens_per_minute.map(|t| t as f64), old.and_then(|o| o.tokens));
            next.insert(name.clone(), ResourceState { limits: *limits, in_use, requests, tokens, held });
        }
        self.state = next;
        // Permits of live attempts on resources that are still defined.
        let holders = std::mem::take(&mut self.holders);
        for s in self.state.values_mut() {
            s.in_use = 0;
        }
        for (exec, holds) in holders {
            for h in &holds {
                if let Some(s) = self.state.get_mut(&h.name) {
                    s.in_use += h.units;
                }
            }
            self.holders.insert(exec, holds);
        }
    }

    fn admit(&mut self, q: &AdmitQuery<'_>) -> Admit {
        let uses = Self::uses(q.task);
        if uses.is_empty() || q.task.execution.on_resource_busy != OnResourceBusy::Skip {
            return Admit::Pass;
        }
        match self.busy(uses, q.now, true) {
            Some((_, why, _)) => Admit::Skip { reason: SkipReason::ResourceBusy, why },
            None => Admit::Pass,
        }
    }

    fn created(&mut self, q: &AdmitQuery<'_>) -> Vec<super::Write> {
        let uses = Self::uses(q.task);
        if !uses.is_empty() && q.task.execution.on_resource_busy == OnResourceBusy::Skip {
            self.promised.insert(q.run.run_id.clone(), uses.iter().map(|u| (u.name.clone(), u.units)).collect());
        }
        Vec::new()
    }

    fn dispatch(&mut self, q: &DispatchQuery<'_>) -> Dispatch {
        let uses = Self::uses(q.task);
        if uses.is_empty() {
            return Dispatch::Pass;
        }
        match self.busy(uses, q.now, false) {
            None => Dispatch::Pass,
            // Busy when it could go: a `skip` task's run does not wait
            // (runs of `wait` tasks due in the same instant went first).
            Some((_, why, _)) if q.task.execution.on_resource_busy == OnResourceBusy::Skip => {
                Dispatch::Skip { reason: SkipReason::ResourceBusy, why }
            }
            Some((name, reason, until)) => {
                let since = match self.waiting.get(&q.run.run_id) {
                    Some((_, since)) => *since,
                    None => q.now,
                };
                self.waiting.insert(q.run.run_id.clone(), (name, since));
                Dispatch::Wait { reason, until }
            }
        }
    }

    fn dispatched(&mut self, q: &DispatchQuery<'_>, execution_id: &str) -> Vec<Write> {
        let uses = Self::uses(q.task);
        self.promised.remove(&q.run.run_id);
        if let Some((name, since)) = self.waiting.remove(&q.run.run_id) {
            let secs = (q.now - since).num_microseconds().unwrap_or(0).max(0) as f64 / 1e6;
            self.waited.push((name, secs));
        }
        if uses.is_empty() {
            return Vec::new();
        }
        let holds: Vec<ResourceHold> = uses
            .iter()
            .filter(|u| self.state.contains_key(&u.name))
            .map(|u| ResourceHold { name: u.name.clone(), units: u.units, tokens: u.tokens })
            .collect();
        for h in &holds {
            if let Some(s) = self.state.get_mut(&h.name) {
                if let Some(b) = s.requests.as_mut() {
                    b.take(1.0, q.now);
                }
                if let (Some(b), true) = (s.tokens.as_mut(), h.tokens > 0) {
                    b.take(h.tokens as f64, q.now);
                }
            }
        }
        self.reserved_here.insert(execution_id.to_string());
        vec![Write::Holds(holds)]
    }

    fn attempt_ended(&mut self, q: &AttemptQuery<'_>, writes: &mut Vec<Write>) -> AfterAttempt {
        let Some(a) = q.run.attempts.last() else { return AfterAttempt::Pass };
        // Settle the token reservation with the usage it reported.
        let here = self.reserved_here.remove(&a.execution_id);
        let used = a.usage.map(|u| u.input_tokens.saturating_add(u.output_tokens) as f64);
        for h in &a.holds {
            let Some(b) = self.state.get_mut(&h.name).and_then(|s| s.tokens.as_mut()) else { continue };
            let estimate = h.tokens as f64;
            // No report: the estimate stands.
            let actual = used.unwrap_or(estimate);
            // This term's bucket holds the reservation: the difference comes
            // back (or is charged). An earlier term's does not: only usage
            // beyond the estimate is charged, nothing refunded.
            let change = if here { estimate - actual } else { -(actual - estimate).max(0.0) };
            b.settle(change, q.now);
        }
        // Shared back-pressure, on a resource the run's task uses (what the
        // attempt held, or the task's definition now).
        if let Some(name) = q.agent.resource.as_deref()
            && matches!(q.outcome, Outcome::RateLimited | Outcome::QuotaExhausted)
        {
            let used = a.holds.iter().any(|h| h.name == name) || q.task.is_some_and(|t| Self::uses(t).iter().any(|u| u.name == name));
            if !used {
                tracing::warn!(
                    run_id = %q.run.run_id,
                    resource = name,
                    "the agent named a resource its task does not use: not held back"
                );
                return AfterAttempt::Pass;
            }
            let (until, why) = if q.outcome == Outcome::RateLimited {
                (q.agent.retry_at.unwrap_or(q.now), format!("rate limited (run {})", q.run.run_id))
            } else {
                let class = q.agent.class.as_deref().map(|c| format!(", {c}")).unwrap_or_default();
                (q.now + self.quota_backoff, format!("quota exhausted (run {}{class})", q.run.run_id))
            };
            if until > q.now && self.hold(name, until, why.clone()) {
                writes.push(Write::Op(StoreOp::PutHoldBack { resource: name.to_string(), hold: HoldBack { until, why } }));
            }
        }
        AfterAttempt::Pass
    }

    fn run_changed(&mut self, run: &RunRecord) {
        for a in &run.attempts {
            if a.holds.is_empty() {
                continue;
            }
            let live = a.is_open() || a.awaiting_runner;
            if live && !self.holders.contains_key(&a.execution_id) {
                for h in &a.holds {
                    if let Some(s) = self.state.get_mut(&h.name) {
                        s.in_use += h.units;
                    }
                }
                self.holders.insert(a.execution_id.clone(), a.holds.clone());
            } else if !live {
                self.release(&a.execution_id);
            }
        }
        if run.status.is_terminal() || run.current_attempt().is_some() {
            self.promised.remove(&run.run_id);
            self.waiting.remove(&run.run_id);
        }
        // A hold a previous leader knew of is loaded from `holds/`
        // (`load_holds`), not derived again from a run waiting out its rate
        // limit: that undid a `resources release`.
    }

    fn run_forgotten(&mut self, run: &RunRecord) {
        for a in &run.attempts {
            self.release(&a.execution_id);
            self.reserved_here.remove(&a.execution_id);
        }
        self.promised.remove(&run.run_id);
        self.waiting.remove(&run.run_id);
    }
}

#[cfg(test)]
mod tests {
    use super::super::AgentOutcome;
    use super::*;
    use crate::model::run::{TriggerKind, Usage};
    use crate::model::{Attempt, RunStatus};

    fn t(s: &str) -> DateTime<Utc> {
        s.parse().expect("t")
    }

    fn config(yaml: &str) -> Config {
        Config::from_text(yaml).expect("config")
    }

    fn task(id: &str, resources: serde_json::Value, busy: &str) -> TaskSpec {
        let j = serde_json::json!({"task_id": id, "agent_id": "a", "execution": {"resources": resources, "on_resource_busy": busy}});
        TaskSpec::from_json(&j.to_string()).expect("task")
    }

    fn run(id: &str, task: &str, now: DateTime<Utc>) -> RunRecord {
        RunRecord::pending(id.into(), task, "a", TriggerKind::Manual, now, now)
    }

    /// Dispatches `run` of `spec` if the policy lets it; the attempt it
    /// gets, with what it holds, is pushed on the run.
    fn try_dispatch(p: &mut Resources, spec: &TaskSpec, run: &mut RunRecord, now: DateTime<Utc>) -> Dispatch {
        let q = DispatchQuery { now, run, task: spec, live_agents: 0 };
        let d = p.dispatch(&q);
        if d == Dispatch::Pass {
            let exec = format!("{}-e{}", run.run_id, run.attempts.len());
            let holds = p
                .dispatched(&DispatchQuery { now, run, task: spec, live_agents: 0 }, &exec)
                .into_iter()
                .flat_map(|w| match w {
                    Write::Holds(h) => h,
                    _ => Vec::new(),
                })
                .collect();
            run.attempts.push(Attempt { execution_id: exec, dispatched_at: now, holds, ..Default::default() });
            run.status = RunStatus::Running;
            p.run_changed(run);
        }
        d
    }

    fn end(p: &mut Resources, run: &mut RunRecord, now: DateTime<Utc>, outcome: Outcome, usage: Option<Usage>, agent: &AgentOutcome) {
        let a = run.attempts.last_mut().expect("attempt");
        a.outcome = Some(outcome);
        a.finished_at = Some(now);
        a.usage = usage;
        p.attempt_ended(&AttemptQuery { now, run, task: None, outcome, agent, error: None }, &mut Vec::new());
        p.run_changed(run);
    }

    #[test]
    fn the_token_bucket_refills_a_minutes_capacity_and_carries_debt() {
        let t0 = t("2026-12-01T10:00:00Z");
        let mut b = Bucket::empty(60.0);
        b.refill(t0);
        // Empty at the start: one token a second.
        assert_eq!(b.ready_at(1.0, t0), Some(t0 + Duration::seconds(1)));
        assert_eq!(b.ready_at(1.0, t0 + Duration::seconds(1)), None);
        b.take(1.0, t0 + Duration::seconds(1));
        // Never above capacity however long it rests.
        b.refill(t0 + Duration::hours(1));
        assert_eq!(b.level, 60.0);
        // An estimate above capacity waits for a full bucket, then goes into debt.
        assert_eq!(b.ready_at(100.0, t0 + Duration::hours(1)), None);
        b.take(100.0, t0 + Duration::hours(1));
        assert_eq!(b.level, -40.0);
        assert_eq!(b.ready_at(1.0, t0 + Duration::hours(1)), Some(t0 + Duration::hours(1) + Duration::seconds(41)));
        // Settling: a refund, capped at capacity.
        b.settle(500.0, t0 + Duration::hours(1));
        assert_eq!(b.level, 60.0);
        // A wall clock step back refills nothing.
        b.take(60.0, t0 + Duration::hours(1));
        b.refill(t0);
        assert_eq!(b.level, 0.0);
        // Found by an attack: usage of 10^18 tokens made a debt of 10^9
        // minutes (and, larger, an instant past chrono's range: a panic
        // at the next dispatch). The debt stops at MAX_DEBT_MINUTES.
        let t1 = t0 + Duration::hours(2);
        b.settle(-1e18, t1);
        assert_eq!(b.level, -60.0 * MAX_DEBT_MINUTES);
        assert_eq!(b.ready_at(1.0, t1), Some(t1 + Duration::milliseconds(((MAX_DEBT_MINUTES * 60.0 + 1.0) * 1000.0) as i64)));
    }

    /// At most `concurrency` units live across tasks; a permit follows its
    /// agent (an ended attempt awaiting its runner keeps it); waiting runs
    /// say why.
    #[test]
    fn concurrency_permits_follow_live_agents() {
        let now = t("2026-12-01T10:00:00Z");
        let mut p = Resources::default();
        p.configure(&config("resources:\n  search-api: {concurrency: 3}\n"));
        let one = task("one", serde_json::json!(["search-api"]), "wait");
        let two = task("two", serde_json::json!([{"name": "search-api", "units": 2}]), "wait");
        let mut a = run("one.1", "one", now);
        let mut b = run("two.1", "two", now);
        let mut c = run("one.2", "one", now);
        assert_eq!(try_dispatch(&mut p, &one, &mut a, now), Dispatch::Pass);
        assert_eq!(try_dispatch(&mut p, &two, &mut b, now), Dispatch::Pass);
        match try_dispatch(&mut p, &one, &mut c, now) {
            Dispatch::Wait { reason, until } => {
                assert_eq!(reason, "resource search-api (3/3 in use)");
                assert_eq!(until, None);
            }
            d => panic!("{d:?}"),
        }
        assert_eq!(p.views(now)[0].waiting, 1);
        // Cancelled, its agent not yet gone: still held.
        a.attempts[0].awaiting_runner = true;
        end(&mut p, &mut a, now, Outcome::Cancelled, None, &AgentOutcome::default());
        assert!(matches!(try_dispatch(&mut p, &one, &mut c, now), Dispatch::Wait { .. }));
        // The runner says it is gone: the permit is free.
        a.attempts[0].awaiting_runner = false;
        p.run_changed(&a);
        assert_eq!(try_dispatch(&mut p, &one, &mut c, now + Duration::seconds(3)), Dispatch::Pass);
        assert_eq!(p.take_waited(), vec![("search-api".to_string(), 3.0)]);
        assert_eq!(p.views(now)[0].in_use, 3);
    }

    /// A new leader rebuilds permits from the attempts of the runs it
    /// loads, and counts each rate window as full.
    #[test]
    fn a_new_leader_rebuilds_permits_and_starts_rate_windows_full() {
        let now = t("2026-12-01T10:00:00Z");
        let cfg = config("resources:\n  openai: {concurrency: 2, requests_per_minute: 60}\n");
        let spec = task("t", serde_json::json!(["openai"]), "wait");
        let mut old = Resources::default();
        old.configure(&cfg);
        let mut runs: Vec<RunRecord> = (0..3).map(|i| run(&format!("t.{i}"), "t", now)).collect();
        // The old leader: a minute's requests were available to it.
        for r in runs.iter_mut().take(2) {
            old.state.get_mut("openai").expect("r").requests.as_mut().expect("b").level = 60.0;
            assert_eq!(try_dispatch(&mut old, &spec, r, now), Dispatch::Pass);
        }
        // The new leader loads the active runs.
        let mut new = Resources::default();
        new.configure(&cfg);
        for r in &runs {
            new.run_changed(r);
        }
        assert_eq!(new.views(now)[0].in_use, 2);
        // One agent ends: a permit is free, but no request is yet (the
        // window counts as full): the next one can go a second later.
        end(&mut new, &mut runs[0], now, Outcome::Succeeded, None, &AgentOutcome::default());
        match try_dispatch(&mut new, &spec, &mut runs[2], now) {
            Dispatch::Wait { reason, until } => {
                assert_eq!(reason, "resource openai at requests_per_minute 60");
                assert_eq!(until, Some(now + Duration::seconds(1)));
            }
            d => panic!("{d:?}"),
        }
        assert_eq!(try_dispatch(&mut new, &spec, &mut runs[2], now + Duration::seconds(1)), Dispatch::Pass);
    }

    /// Tokens: the estimate is reserved at dispatch and settled with the
    /// reported usage.
    #[test]
    fn token_reservations_settle_with_usage() {
        let now = t("2026-12-01T10:00:00Z");
        let mut p = Resources::default();
        p.configure(&config("resources:\n  openai: {tokens_per_minute: 10000}\n"));
        p.state.get_mut("openai").expect("r").tokens.as_mut().expect("b").level = 10000.0;
        let spec = task("t", serde_json::json!([{"name": "openai", "tokens": 4000}]), "wait");
        let mut r1 = run("t.1", "t", now);
        let mut r2 = run("t.2", "t", now);
        let mut r3 = run("t.3", "t", now);
        assert_eq!(try_dispatch(&mut p, &spec, &mut r1, now), Dispatch::Pass);
        assert_eq!(try_dispatch(&mut p, &spec, &mut r2, now), Dispatch::Pass);
        // 2000 left: the third waits 12 s for 2000 more (10000 per minute).
        assert!(
            matches!(try_dispatch(&mut p, &spec, &mut r3, now), Dispatch::Wait { until: Some(u), .. } if u == now + Duration::seconds(12))
        );
        // The first used 1000 of its 4000: 3000 come back.
        let usage = Usage { input_tokens: 600, output_tokens: 400, ..Default::default() };
        end(&mut p, &mut r1, now, Outcome::Succeeded, Some(usage), &AgentOutcome::default());
        assert_eq!(p.views(now)[0].tokens_available, Some(5000.0));
        assert_eq!(try_dispatch(&mut p, &spec, &mut r3, now), Dispatch::Pass);
        // The second used 9000: 5000 beyond its estimate are a debt.
        let usage = Usage { input_tokens: 8000, output_tokens: 1000, ..Default::default() };
        end(&mut p, &mut r2, now, Outcome::Succeeded, Some(usage), &AgentOutcome::default());
        assert_eq!(p.state["openai"].tokens.as_ref().map(|b| b.level), Some(-4000.0));
    }

    /// A 429 naming the resource holds it back for every task until its
    /// retry_at; quota exhaustion for quota_backoff; a skip task's slot is
    /// SKIPPED resource_busy meanwhile.
    #[test]
    fn hold_backs_are_shared_and_skips_name_the_resource() {
        let now = t("2026-12-01T10:00:00Z");
        let mut p = Resources::default();
        p.configure(&config("quota_backoff: 10m\nresources:\n  openai: {concurrency: 50}\n"));
        let spec = task("t", serde_json::json!(["openai"]), "wait");
        let other = task("u", serde_json::json!(["openai"]), "wait");
        let skipper = task("s", serde_json::json!(["openai"]), "skip");
        let mut r = run("t.1", "t", now);
        assert_eq!(try_dispatch(&mut p, &spec, &mut r, now), Dispatch::Pass);
        let retry_at = now + Duration::seconds(2);
        let said = AgentOutcome { resource: Some("openai".into()), retry_at: Some(retry_at), ..Default::default() };
        end(&mut p, &mut r, now, Outcome::RateLimited, None, &said);
        let mut u = run("u.1", "u", now);
        match try_dispatch(&mut p, &other, &mut u, now) {
            Dispatch::Wait { reason, until } => {
                assert_eq!(reason, "resource openai held back until 2026-12-01T10:00:02.000Z: rate limited (run t.1)");
                assert_eq!(until, Some(retry_at));
            }
            d => panic!("{d:?}"),
        }
        let s = run("s.1", "s", now);
        let admit = p.admit(&AdmitQuery { now, run: &s, task: &skipper, paused: false, active: 0, active_runs: &[], breaker: None });
        assert!(matches!(admit, Admit::Skip { reason: SkipReason::ResourceBusy, ref why } if why.contains("held back")), "{admit:?}");
        assert_eq!(try_dispatch(&mut p, &other, &mut u, retry_at), Dispatch::Pass, "free at retry_at");
        let said = AgentOutcome { resource: Some("openai".into()), class: Some("insufficient_quota".into()), ..Default::default() };
        end(&mut p, &mut u, retry_at, Outcome::QuotaExhausted, None, &said);
        let snap = &p.views(retry_at)[0];
        assert_eq!(snap.held_until, Some(retry_at + Duration::minutes(10)));
        assert_eq!(snap.held_why, "quota exhausted (run u.1, insufficient_quota)");
    }

    /// `skip` runs admitted but not yet dispatched count against the
    /// concurrency of the next skip admission: two slots due at once on a
    /// resource of 1 leave one run and one SKIPPED record.
    #[test]
    fn skip_admissions_count_promised_permits() {
        let now = t("2026-12-01T10:00:00Z");
        let mut p = Resources::default();
        p.configure(&config("resources:\n  search-api: {concurrency: 1}\n"));
        let a = task("a", serde_json::json!(["search-api"]), "skip");
        let b = task("b", serde_json::json!(["search-api"]), "skip");
        let ra = run("a.1", "a", now);
        let rb = run("b.1", "b", now);
        let q = AdmitQuery { now, run: &ra, task: &a, paused: false, active: 0, active_runs: &[], breaker: None };
        assert_eq!(p.admit(&q), Admit::Pass);
        p.created(&q);
        let q = AdmitQuery { now, run: &rb, task: &b, paused: false, active: 0, active_runs: &[], breaker: None };
        assert!(
            matches!(p.admit(&q), Admit::Skip { reason: SkipReason::ResourceBusy, ref why } if why == "resource search-api (1/1 in use)")
        );
    }

    /// Issue 34, finding 4: a `skip` task due in the same instant as runs
    /// of `wait` tasks was admitted (their runs did not count yet), then
    /// waited behind them, PENDING and late every minute, with no
    /// `resource_busy` record. Busy when it can go, it is SKIPPED then.
    #[test]
    fn a_skip_run_that_finds_its_resource_busy_at_dispatch_is_skipped() {
        let now = t("2026-12-01T10:00:00Z");
        let mut p = Resources::default();
        p.configure(&config("resources:\n  search-api: {concurrency: 1}\n"));
        let waiter = task("w", serde_json::json!(["search-api"]), "wait");
        let skipper = task("s", serde_json::json!(["search-api"]), "skip");
        let mut s = run("s.1", "s", now);
        let q = AdmitQuery { now, run: &s, task: &skipper, paused: false, active: 0, active_runs: &[], breaker: None };
        assert_eq!(p.admit(&q), Admit::Pass, "nothing holds it when its slot is due");
        p.created(&q);
        let mut w = run("w.1", "w", now);
        assert_eq!(try_dispatch(&mut p, &waiter, &mut w, now), Dispatch::Pass, "the wait task's run went first");
        match try_dispatch(&mut p, &skipper, &mut s, now) {
            Dispatch::Skip { reason: SkipReason::ResourceBusy, why } => assert_eq!(why, "resource search-api (1/1 in use)"),
            d => panic!("{d:?}"),
        }
    }

    /// Issue 34, findings 2 and 5: a hold-back is written with the attempt
    /// that asked for it and a new leader holds it again; an agent cannot
    /// freeze a resource its task does not use; a hold can be released.
    #[test]
    fn hold_backs_are_stored_loaded_released_and_only_on_the_tasks_resources() {
        let now = t("2026-12-01T10:00:00Z");
        let cfg = config("quota_backoff: 10m\nresources:\n  search: {concurrency: 5}\n  payments: {concurrency: 5}\n");
        let mut p = Resources::default();
        p.configure(&cfg);
        let spec = task("t", serde_json::json!(["search"]), "wait");
        let mut r = run("t.1", "t", now);
        assert_eq!(try_dispatch(&mut p, &spec, &mut r, now), Dispatch::Pass);
        // It names `payments`, which its task does not use: nothing is held.
        let said = AgentOutcome { resource: Some("payments".into()), ..Default::default() };
        let a = r.attempts.last_mut().expect("attempt");
        a.outcome = Some(Outcome::QuotaExhausted);
        let mut writes = Vec::new();
        p.attempt_ended(
            &AttemptQuery { now, run: &r, task: Some(&spec), outcome: Outcome::QuotaExhausted, agent: &said, error: None },
            &mut writes,
        );
        assert!(writes.is_empty());
        assert!(p.views(now).iter().all(|s| s.held_until.is_none()));
        // It names `search`: held for quota_backoff, and the hold is written.
        let said = AgentOutcome { resource: Some("search".into()), ..Default::default() };
        p.attempt_ended(
            &AttemptQuery { now, run: &r, task: Some(&spec), outcome: Outcome::QuotaExhausted, agent: &said, error: None },
            &mut writes,
        );
        let until = now + Duration::minutes(10);
        let stored = match &writes[..] {
            [Write::Op(StoreOp::PutHoldBack { resource, hold })] if resource == "search" && hold.until == until => hold.clone(),
            w => panic!("{w:?}"),
        };
        // A new leader (no run to derive it from) loads it.
        let mut next = Resources::default();
        next.configure(&cfg);
        next.load_holds(vec![("search".into(), stored.clone()), ("gone".into(), stored)], now + Duration::minutes(1));
        let snap = next.views(now + Duration::minutes(1));
        assert_eq!(snap.iter().find(|s| s.name == "search").and_then(|s| s.held_until), Some(until));
        // Released by hand: free at once.
        assert!(next.release_hold("search", now + Duration::minutes(1)).expect("defined"));
        assert!(next.views(now).iter().all(|s| s.held_until.is_none()));
        assert!(next.release_hold("nope", now).is_err());
        // A leader after the release loads the run still waiting out its
        // rate limit, and no stored hold (the release deleted it): the
        // resource stays free (it was held again from the run, undoing the
        // release; found attacking issue 34's release).
        let a = r.attempts.last_mut().expect("attempt");
        a.outcome = Some(Outcome::RateLimited);
        a.resource = Some("search".into());
        a.retry_at = Some(now + Duration::hours(1));
        r.status = RunStatus::Retrying;
        let mut after = Resources::default();
        after.configure(&cfg);
        after.load_holds(Vec::new(), now + Duration::minutes(1));
        after.run_changed(&r);
        assert!(after.views(now + Duration::minutes(1)).iter().all(|s| s.held_until.is_none()), "the release is undone");
    }
}
