//! Budgets (`budgets:` of the config): limits on what the runs of a scope
//! (a task, an agent's tasks, the tasks with some labels) spend over a
//! calendar window — cost, input and output tokens, runs.
//!
//! - **admission**: a run whose scope's spend (settled plus reserved) plus
//!   its own estimate would pass a hard limit is a SKIPPED
//!   `budget_exceeded` record naming the budget, used / limit and when the
//!   window resets (`on_exceeded: pause` also pauses the task);
//! - **reservation**: an admitted run reserves its task's estimate — the
//!   p95 of the task's recent runs, else the window's mean per run — so a
//!   burst of slots due at once cannot overshoot by the burst: spend ends
//!   within one run's estimate of the limit. The charge is on the run
//!   record ([`RunRecord::charges`]), and a new leader re-reserves it for
//!   the runs it loads;
//! - **no estimate yet**: a run admitted when nothing can estimate it (no
//!   settled run of its task, none in the window) under a budget that
//!   limits cost or tokens reserves only its run ([`BudgetCharge::unknown`]).
//!   The first such run of a window goes and is the window's probe; the
//!   others wait at dispatch (`waiting for run X to settle`) and, once it
//!   has, are estimated from it — the ones that do not fit end SKIPPED
//!   `budget_exceeded` without having run. A new leader knows the probe
//!   from the runs it loads (an unknown charge on a dispatched run);
//! - **settlement**: when the run ends, its real usage (cost as reported,
//!   else tokens times the model's price) replaces the reservation, and a
//!   ledger entry is written in the same fenced transaction as its final
//!   record ([`crate::repo::budgets`]): a failover neither forgets spend
//!   nor counts it twice;
//! - **soft limit**: the run whose settlement crosses `soft_percent` of a
//!   limit sends the budget's `on_budget` notifications, once per window
//!   (a window loaded already past it is not announced again).

use std::collections::{BTreeMap, HashMap, VecDeque};

use chrono::{DateTime, Utc};

use super::{Admit, AdmitQuery, Dispatch, DispatchQuery, FinishQuery, Policy, Write};
use crate::config::{BudgetDef, BudgetScope, BudgetWindow, Config, OnExceeded, Price};
use crate::model::budget::{Amount, BudgetCharge};
use crate::model::notification::{NotifyEvent, for_sinks};
use crate::model::run::{SkipReason, Usage};
use crate::model::{RunRecord, RunStatus};
use crate::repo::StoreOp;
use crate::repo::budgets::LedgerWindow;
use crate::views::BudgetView;

/// Finished runs per task the estimate is taken from.
pub const ESTIMATE_RUNS: usize = 20;

/// See the module docs.
#[derive(Debug, Default)]
pub struct Budgets {
    defs: Vec<BudgetDef>,
    prices: BTreeMap<String, Price>,
    /// Settled spend by (budget, window start).
    used: HashMap<(String, DateTime<Utc>), Amount>,
    /// Reserved, by (budget, window start): the sum of `charges`.
    reserved: HashMap<(String, DateTime<Utc>), Amount>,
    /// The charges of runs admitted and not yet settled.
    charges: HashMap<String, Vec<BudgetCharge>>,
    /// The charges decided by the last `admit`, taken by `created`.
    pending: Option<(String, Vec<BudgetCharge>)>,
    /// The last [`ESTIMATE_RUNS`] settled runs of each task.
    recent: HashMap<String, VecDeque<Amount>>,
    /// Per (budget, window start): the run admitted without an estimate
    /// that was dispatched and has not settled (the others wait for it).
    probes: HashMap<(String, DateTime<Utc>), String>,
    /// Windows whose last admission was refused (their `state` is
    /// `exceeded` though what is used may be under the limit: the next
    /// run's estimate does not fit).
    refused: HashMap<(String, DateTime<Utc>), DateTime<Utc>>,
}

/// Why a run would pass a limit: the measure, its use and limit as text,
/// and the run's estimate of it when that, not the use, does not fit.
struct Over {
    what: &'static str,
    used: String,
    limit: String,
    estimate: Option<String>,
}

/// Which measure a run with estimate `est` would take past its limit. A
/// measure already at its limit refuses; else the estimate must fit what is
/// left — except in a window where nothing of it is used or reserved yet,
/// where one run always goes (an estimate above the whole limit would
/// otherwise refuse every window).
fn over(limits: &crate::config::budgets::LimitsSpec, used: Amount, est: Amount) -> Option<Over> {
    let ints = [("runs", limits.runs, used.runs, est.runs), ("input_tokens", limits.input_tokens, used.input_tokens, est.input_tokens)];
    let ints = ints.into_iter().chain([("output_tokens", limits.output_tokens, used.output_tokens, est.output_tokens)]);
    for (what, limit, u, e) in ints {
        if let Some(l) = limit
            && (u >= l || (u > 0 && u.saturating_add(e) > l))
        {
            return Some(Over { what, used: u.to_string(), limit: l.to_string(), estimate: (u < l).then(|| e.to_string()) });
        }
    }
    if let Some(l) = limits.cost
        && (used.cost >= l || (used.cost > 0.0 && used.cost + est.cost > l))
    {
        let estimate = (used.cost < l).then(|| format!("{:.4}", est.cost));
        return Some(Over { what: "cost", used: format!("{:.4}", used.cost), limit: format!("{l}"), estimate });
    }
    None
}

/// Whether `used` is at or past `percent` of any limit.
fn past(limits: &crate::config::budgets::LimitsSpec, used: Amount, percent: u32) -> bool {
    let f = percent as f64 / 100.0;
    let int = |l: Option<u64>, u: u64| l.is_some_and(|l| u as f64 >= l as f64 * f);
    int(limits.runs, used.runs)
        || int(limits.input_tokens, used.input_tokens)
        || int(limits.output_tokens, used.output_tokens)
        || limits.cost.is_some_and(|l| used.cost >= l * f)
}

fn p95(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 * 0.95).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

fn scope_text(s: &BudgetScope) -> String {
    match s {
        BudgetScope::Task(t) => format!("task {t}"),
        BudgetScope::Agent(a) => format!("agent {a}"),
        BudgetScope::Label(l) => format!("label {}", l.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")),
    }
}

fn window_text(w: BudgetWindow) -> &'static str {
    match w {
        BudgetWindow::Hour => "1h",
        BudgetWindow::Day => "1d",
        BudgetWindow::ThirtyDays => "30d",
        BudgetWindow::Month => "month",
    }
}

/// What a run used: its attempts' usage summed, priced by `prices` where
/// an attempt reported tokens and a model but no cost; `runs` 1.
pub fn run_amount(run: &RunRecord, prices: &BTreeMap<String, Price>) -> Amount {
    run.attempts.iter().fold(Amount { runs: 1, ..Amount::default() }, |acc, a| {
        let Some(u) = &a.usage else { return acc };
        let priced = a.model.as_ref().and_then(|m| prices.get(m)).map(|p| p.cost(u));
        acc.plus(Amount { runs: 0, ..Amount::of_run(u, priced) })
    })
}

impl Budgets {
    /// What `usage` of `model` costs by the config's price table, when the
    /// agent reported no cost and the model has a price.
    pub fn price(&self, model: Option<&str>, usage: &Usage) -> Option<f64> {
        (usage.cost == 0.0).then_some(())?;
        self.prices.get(model?).map(|p| p.cost(usage))
    }

    /// Takes the ledger a new leader read from the store.
    pub fn load(&mut self, windows: Vec<LedgerWindow>) {
        for w in windows {
            let e = self.used.entry((w.budget, w.window_start)).or_default();
            *e = e.plus(w.used);
        }
    }

    /// The estimate of one run of `task_id` against `key`'s window: the
    /// p95 of each measure over the task's recent runs, else the window's
    /// mean per settled run; `None` when neither exists.
    fn estimate(&self, task_id: &str, key: &(String, DateTime<Utc>)) -> Option<Amount> {
        if let Some(r) = self.recent.get(task_id).filter(|r| !r.is_empty()) {
            let col = |f: fn(&Amount) -> f64| p95(r.iter().map(f).collect());
            return Some(Amount {
                cost: col(|a| a.cost),
                input_tokens: col(|a| a.input_tokens as f64).ceil() as u64,
                output_tokens: col(|a| a.output_tokens as f64).ceil() as u64,
                runs: 1,
            });
        }
        match self.used.get(key) {
            Some(u) if u.runs > 0 => {
                let n = u.runs;
                Some(Amount {
                    cost: u.cost / n as f64,
                    input_tokens: u.input_tokens.div_ceil(n),
                    output_tokens: u.output_tokens.div_ceil(n),
                    runs: 1,
                })
            }
            _ => None,
        }
    }

    /// Why a run with estimate `est` does not fit budget `d` now (`key`:
    /// its window; `own`: what the run itself has reserved there already),
    /// in the words of its SKIPPED record; `None`: it fits.
    fn refusal(&self, d: &BudgetDef, key: &(String, DateTime<Utc>), end: DateTime<Utc>, est: Amount, own: Amount) -> Option<String> {
        let reserved = self.reserved.get(key).copied().unwrap_or_default().minus(own);
        let used = self.used.get(key).copied().unwrap_or_default().plus(reserved);
        let o = over(&d.limits, used, est)?;
        // When it resets, in the budget's own zone.
        let fits = o.estimate.map(|e| format!(", this run's estimate {e} does not fit")).unwrap_or_default();
        Some(format!(
            "budget {} exceeded: {} {}/{} used or reserved{fits}; resets at {}",
            d.name,
            o.what,
            o.used,
            o.limit,
            end.with_timezone(&d.tz).to_rfc3339()
        ))
    }

    fn reserve(&mut self, run_id: &str, charges: Vec<BudgetCharge>) {
        for c in &charges {
            let e = self.reserved.entry((c.budget.clone(), c.window_start)).or_default();
            *e = e.plus(c.reserved);
        }
        self.charges.insert(run_id.to_string(), charges);
    }

    fn release(&mut self, run_id: &str) -> Vec<BudgetCharge> {
        let charges = self.charges.remove(run_id).unwrap_or_default();
        for c in &charges {
            if let Some(e) = self.reserved.get_mut(&(c.budget.clone(), c.window_start)) {
                *e = e.minus(c.reserved);
            }
        }
        charges
    }

    /// Each budget's current window, for `budgets list` and the metrics.
    pub fn views(&self, now: DateTime<Utc>) -> Vec<BudgetView> {
        self.defs
            .iter()
            .map(|d| {
                let (start, end) = d.window_of(now);
                let key = (d.name.clone(), start);
                let used = self.used.get(&key).copied().unwrap_or_default();
                let reserved = self.reserved.get(&key).copied().unwrap_or_default();
                let nothing = Amount::default();
                let state = if over(&d.limits, used, nothing).is_some() || self.refused.contains_key(&key) {
                    "exceeded"
                } else if past(&d.limits, used, d.soft_percent) {
                    "soft"
                } else {
                    "ok"
                };
                BudgetView {
                    name: d.name.clone(),
                    scope: scope_text(&d.scope),
                    scope_rule: d.scope.clone(),
                    window: window_text(d.window),
                    window_start: start,
                    window_end: end,
                    used,
                    reserved,
                    limits: d.limits,
                    soft_percent: d.soft_percent,
                    on_exceeded: match d.on_exceeded {
                        OnExceeded::Skip => "skip",
                        OnExceeded::Pause => "pause",
                    },
                    state,
                    timezone: d.tz.name().to_string(),
                }
            })
            .collect()
    }

    /// The window end of a budget's window starting at `start` (`None`: no
    /// such budget now), for folding and pruning the ledger.
    pub fn window_end(&self, name: &str, start: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.defs.iter().find(|d| d.name == name).map(|d| d.window_of(start).1)
    }

    /// The `on_budget` notifications of `def`'s window starting at `start`
    /// crossing its soft limit with `run` (one per sink; ids from the
    /// budget and the window, so a receiver deduplicates a repeat).
    fn soft_notifications(def: &BudgetDef, start: DateTime<Utc>, used: Amount, run: &RunRecord, now: DateTime<Utc>) -> Vec<Write> {
        let base = format!("budget-{}-{}", def.name, start.timestamp());
        let (_, end) = def.window_of(start);
        let budget = serde_json::json!({
            "name": def.name, "scope": scope_text(&def.scope), "window_start": start, "window_end": end,
            "used": used, "limits": {"cost": def.limits.cost, "input_tokens": def.limits.input_tokens,
            "output_tokens": def.limits.output_tokens, "runs": def.limits.runs}, "soft_percent": def.soft_percent,
        });
        for_sinks(&def.notify, NotifyEvent::OnBudget, &base, now, run, None)
            .into_iter()
            .map(|mut n| {
                n.payload["budget"] = budget.clone();
                Write::Op(StoreOp::PutNotification(Box::new(n)))
            })
            .collect()
    }
}

impl Policy for Budgets {
    fn name(&self) -> &'static str {
        "budgets"
    }

    fn snapshot(&self, now: DateTime<Utc>, into: &mut crate::views::PolicyViews) {
        into.budgets = self.views(now);
    }

    fn configure(&mut self, config: &Config) {
        self.defs = config.budgets.clone();
        self.prices = config.prices.clone();
    }

    fn run_changed(&mut self, run: &RunRecord) {
        if run.status.is_terminal() {
            // Skipped without running (at dispatch): nothing to settle.
            if run.status == RunStatus::Skipped {
                self.release(&run.run_id);
                self.probes.retain(|_, r| *r != run.run_id);
            }
            return;
        }
        // A run loaded by a new leader re-reserves what it was charged.
        if !run.charges.is_empty() && !self.charges.contains_key(&run.run_id) {
            self.reserve(&run.run_id, run.charges.clone());
        }
        // ... and a dispatched run without an estimate is its window's probe.
        if !run.attempts.is_empty() {
            for c in run.charges.iter().filter(|c| c.unknown) {
                self.probes.entry((c.budget.clone(), c.window_start)).or_insert_with(|| run.run_id.clone());
            }
        }
    }

    fn run_forgotten(&mut self, run: &RunRecord) {
        self.release(&run.run_id);
        self.probes.retain(|_, r| *r != run.run_id);
    }

    fn admit(&mut self, q: &AdmitQuery<'_>) -> Admit {
        self.pending = None;
        let mut charges = Vec::new();
        let covering: Vec<usize> =
            (0..self.defs.len()).filter(|&i| self.defs[i].scope.covers(&q.run.task_id, &q.run.agent_id, &q.task.labels)).collect();
        for i in covering {
            let d = &self.defs[i];
            let (start, end) = d.window_of(q.now);
            let key = (d.name.clone(), start);
            let limits_spend = d.limits.cost.is_some() || d.limits.input_tokens.is_some() || d.limits.output_tokens.is_some();
            let (est, unknown) = match self.estimate(&q.run.task_id, &key) {
                Some(e) => (e, false),
                None => (Amount { runs: 1, ..Amount::default() }, limits_spend),
            };
            if let Some(why) = self.refusal(d, &key, end, est, Amount::default()) {
                let on_exceeded = d.on_exceeded;
                self.refused.insert(key, q.now);
                return match on_exceeded {
                    OnExceeded::Skip => Admit::Skip { reason: SkipReason::BudgetExceeded, why },
                    OnExceeded::Pause => Admit::SkipAndPause { reason: SkipReason::BudgetExceeded, why },
                };
            }
            charges.push(BudgetCharge { budget: d.name.clone(), window_start: start, reserved: est, unknown });
        }
        if !charges.is_empty() {
            self.pending = Some((q.run.run_id.clone(), charges));
        }
        Admit::Pass
    }

    fn dispatch(&mut self, q: &DispatchQuery<'_>) -> Dispatch {
        for c in q.run.charges.iter().filter(|c| c.unknown) {
            let key = (c.budget.clone(), c.window_start);
            let Some(d) = self.defs.iter().find(|d| d.name == c.budget) else { continue };
            match self.estimate(&q.run.task_id, &key) {
                // The probe settled (or the window has runs): estimated now.
                Some(est) => {
                    let (_, end) = d.window_of(c.window_start);
                    if let Some(why) = self.refusal(d, &key, end, est, c.reserved) {
                        self.refused.insert(key, q.now);
                        return Dispatch::Skip { reason: SkipReason::BudgetExceeded, why };
                    }
                }
                None => match self.probes.get(&key) {
                    Some(probe) if *probe != q.run.run_id => {
                        return Dispatch::Wait {
                            reason: format!("budget {}: waiting for run {probe} to settle, to estimate what a run costs", c.budget),
                            until: None,
                        };
                    }
                    // It goes as the window's probe.
                    _ => {}
                },
            }
        }
        Dispatch::Pass
    }

    fn dispatched(&mut self, q: &DispatchQuery<'_>, _execution_id: &str) -> Vec<Write> {
        let mut estimated = Vec::new();
        for c in q.run.charges.iter().filter(|c| c.unknown) {
            let key = (c.budget.clone(), c.window_start);
            match self.estimate(&q.run.task_id, &key) {
                Some(est) => estimated.push(BudgetCharge { reserved: est, unknown: false, ..c.clone() }),
                None => {
                    self.probes.insert(key, q.run.run_id.clone());
                }
            }
        }
        if estimated.is_empty() {
            return Vec::new();
        }
        // The run's reservation becomes its estimate.
        let mut charges = self.release(&q.run.run_id);
        charges.retain(|c| !estimated.iter().any(|n| n.budget == c.budget && n.window_start == c.window_start));
        charges.extend(estimated.iter().cloned());
        self.reserve(&q.run.run_id, charges);
        vec![Write::Charges(estimated)]
    }

    fn created(&mut self, q: &AdmitQuery<'_>) -> Vec<Write> {
        match self.pending.take() {
            Some((run_id, charges)) if run_id == q.run.run_id => {
                self.reserve(&run_id, charges.clone());
                vec![Write::Charges(charges)]
            }
            _ => Vec::new(),
        }
    }

    fn finished(&mut self, q: &FinishQuery<'_>) -> Vec<Write> {
        let charges = self.release(&q.run.run_id);
        self.probes.retain(|_, r| *r != q.run.run_id);
        if charges.is_empty() {
            return Vec::new();
        }
        let amount = run_amount(q.run, &self.prices);
        let recent = self.recent.entry(q.run.task_id.clone()).or_default();
        if recent.len() == ESTIMATE_RUNS {
            recent.pop_front();
        }
        recent.push_back(amount);
        let mut writes = Vec::new();
        for c in charges {
            let key = (c.budget.clone(), c.window_start);
            let before = self.used.get(&key).copied().unwrap_or_default();
            let after = before.plus(amount);
            self.used.insert(key.clone(), after);
            // What was refused may fit now; the next refusal says so again.
            self.refused.remove(&key);
            writes.push(Write::Op(StoreOp::PutCharge {
                budget: c.budget.clone(),
                window_start: c.window_start,
                run_id: q.run.run_id.clone(),
                amount,
            }));
            if let Some(d) = self.defs.iter().find(|d| d.name == c.budget)
                && !d.notify.is_empty()
                && !past(&d.limits, before, d.soft_percent)
                && past(&d.limits, after, d.soft_percent)
            {
                writes.extend(Self::soft_notifications(d, c.window_start, after, q.run, q.now));
            }
        }
        writes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(input: u64, output: u64, cost: f64) -> Usage {
        Usage { input_tokens: input, output_tokens: output, cache_read_input_tokens: 0, cost, cost_priced: false }
    }
    use crate::config::budgets::{BudgetSpec, LimitsSpec, ScopeSpec, validate};
    use crate::model::RunStatus;
    use crate::model::run::TriggerKind;
    use crate::model::task::TaskSpec;
    use crate::notify::NotifyConfig;

    fn t(s: &str) -> DateTime<Utc> {
        s.parse().expect("t")
    }

    fn policy(limits: LimitsSpec, on_exceeded: OnExceeded) -> Budgets {
        let spec = BudgetSpec {
            name: "b".into(),
            scope: ScopeSpec { agent: Some("ag".into()), ..Default::default() },
            window: "1h".into(),
            timezone: None,
            limits,
            soft_percent: 50,
            on_exceeded,
            notify: vec!["https://example.invalid/hook".into()],
        };
        let def = validate(0, &spec, &NotifyConfig::default()).expect("valid");
        let config = Config { budgets: vec![def], ..Config::default() };
        let mut b = Budgets::default();
        b.configure(&config);
        b
    }

    fn task() -> TaskSpec {
        TaskSpec::from_json(r#"{"task_id": "t", "agent_id": "ag"}"#).expect("task")
    }

    /// Admits one run at `now`; `Some(charges)` when admitted.
    fn admit(b: &mut Budgets, id: &str, now: DateTime<Utc>) -> Result<Vec<BudgetCharge>, Admit> {
        let task = task();
        let mut run = RunRecord::pending(id.into(), "t", "ag", TriggerKind::Manual, now, now);
        let q = AdmitQuery { now, run: &run, task: &task, paused: false, active: 0, active_runs: &[], breaker: None };
        match b.admit(&q) {
            Admit::Pass => {}
            other => return Err(other),
        }
        let charges = match b.created(&q).pop() {
            Some(Write::Charges(c)) => c,
            _ => Vec::new(),
        };
        run.charges = charges.clone();
        b.run_changed(&run);
        Ok(charges)
    }

    /// Ends run `id` having used `u`; the writes.
    fn finish(b: &mut Budgets, id: &str, now: DateTime<Utc>, u: Usage) -> Vec<Write> {
        let mut run = RunRecord::pending(id.into(), "t", "ag", TriggerKind::Manual, now, now);
        run.status = RunStatus::Succeeded;
        run.attempts.push(crate::model::Attempt { usage: Some(u), ..crate::model::Attempt::default() });
        b.finished(&FinishQuery { now, run: &run, task: None, breaker: None })
    }

    #[test]
    fn the_eleventh_run_of_ten_is_skipped_and_names_the_budget() {
        let now = t("2026-12-02T10:20:00Z");
        let mut b = policy(LimitsSpec { runs: Some(10), ..Default::default() }, OnExceeded::Skip);
        for i in 0..10 {
            admit(&mut b, &format!("r{i}"), now).expect("admitted");
        }
        match admit(&mut b, "r10", now) {
            Err(Admit::Skip { reason: SkipReason::BudgetExceeded, why }) => {
                assert!(why.contains("budget b exceeded: runs 10/10"), "{why}");
                assert!(why.contains("resets at 2026-12-02T11:00:00"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        // The next window starts from nothing.
        admit(&mut b, "next", t("2026-12-02T11:00:00Z")).expect("a new window");
    }

    /// Found by an attack: a task whose estimate is above a whole limit
    /// was refused in every window (its estimate never changed). In a
    /// window with nothing used one run goes; then the limit holds.
    #[test]
    fn an_estimate_above_the_limit_still_runs_once_per_window() {
        let now = t("2026-12-02T10:20:00Z");
        let mut b = policy(LimitsSpec { cost: Some(2.0), ..Default::default() }, OnExceeded::Skip);
        admit(&mut b, "r0", now).expect("admitted");
        finish(&mut b, "r0", now, usage(0, 0, 5.0));
        match admit(&mut b, "r1", now) {
            Err(Admit::Skip { why, .. }) => assert!(why.contains("cost 5.0000/2 used or reserved; resets at"), "{why}"),
            other => panic!("{other:?}"),
        }
        let next = t("2026-12-02T11:20:00Z");
        admit(&mut b, "r2", next).expect("the next window takes one run");
        match admit(&mut b, "r3", next) {
            Err(Admit::Skip { why, .. }) => assert!(why.contains("cost 5.0000/2 used or reserved"), "{why}"),
            other => panic!("{other:?}"),
        }
        finish(&mut b, "r2", next, usage(0, 0, 0.5));
        // 0.5 used: the estimate (p95 of 5 and 0.5) does not fit what is left.
        match admit(&mut b, "r4", next) {
            Err(Admit::Skip { why, .. }) => {
                assert!(why.contains("cost 0.5000/2 used or reserved, this run's estimate 5.0000 does not fit"), "{why}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn pause_skips_and_pauses() {
        let now = t("2026-12-02T10:20:00Z");
        let mut b = policy(LimitsSpec { runs: Some(0), ..Default::default() }, OnExceeded::Pause);
        assert!(matches!(admit(&mut b, "r", now), Err(Admit::SkipAndPause { reason: SkipReason::BudgetExceeded, .. })));
    }

    /// Reservations hold a burst to the limit; settlement replaces the
    /// estimate with what was used and writes the run's ledger entry.
    #[test]
    fn a_burst_reserves_the_p95_and_settles_what_was_used() {
        let now = t("2026-12-02T10:20:00Z");
        let mut b = policy(LimitsSpec { output_tokens: Some(10_000), ..Default::default() }, OnExceeded::Skip);
        // History: runs of 900 and 1,000 output tokens (p95: 1,000).
        for (i, out) in [900, 1000, 900].into_iter().enumerate() {
            let id = format!("h{i}");
            admit(&mut b, &id, now).expect("admitted");
            let w = finish(&mut b, &id, now, usage(10, out, 0.0));
            assert!(w.iter().any(
                |w| matches!(w, Write::Op(StoreOp::PutCharge { run_id, amount, .. }) if *run_id == id && amount.output_tokens == out)
            ));
        }
        // 2,800 used; each new run reserves 1,000: 7 more fit, not 50.
        let admitted = (0..50).filter(|i| admit(&mut b, &format!("b{i}"), now).is_ok()).count();
        assert_eq!(admitted, 7);
        let snap = &b.views(now)[0];
        assert_eq!((snap.used.output_tokens, snap.reserved.output_tokens, snap.reserved.runs), (2800, 7000, 7));
        // Each used 1,100: the end is within one estimate of the limit.
        for i in 0..50 {
            finish(&mut b, &format!("b{i}"), now, usage(10, 1100, 0.0));
        }
        let snap = &b.views(now)[0];
        assert_eq!((snap.used.output_tokens, snap.used.runs, snap.reserved.runs), (2800 + 7 * 1100, 10, 0));
        assert!(snap.used.output_tokens.abs_diff(10_000) <= 1100);
        assert_eq!(snap.state, "exceeded");
    }

    /// A new leader's policy: the ledger from the store and the loaded
    /// runs' charges give the same view as before the failover.
    #[test]
    fn a_new_leader_rebuilds_from_the_ledger_and_the_runs_charges() {
        let now = t("2026-12-02T10:20:00Z");
        let limits = LimitsSpec { runs: Some(5), ..Default::default() };
        let mut old = policy(limits, OnExceeded::Skip);
        let mut open = Vec::new();
        for i in 0..4 {
            let c = admit(&mut old, &format!("r{i}"), now).expect("admitted");
            open.push((format!("r{i}"), c));
        }
        finish(&mut old, "r0", now, usage(1, 1, 0.25));
        let mut new = policy(limits, OnExceeded::Skip);
        let start = t("2026-12-02T10:00:00Z");
        new.load(vec![LedgerWindow {
            budget: "b".into(),
            window_start: start,
            used: Amount { runs: 1, cost: 0.25, input_tokens: 1, output_tokens: 1 },
        }]);
        for (id, charges) in open.iter().skip(1) {
            let mut run = RunRecord::pending(id.clone(), "t", "ag", TriggerKind::Manual, now, now);
            run.charges = charges.clone();
            new.run_changed(&run);
            new.run_changed(&run);
        }
        assert_eq!(new.views(now), old.views(now));
        admit(&mut new, "r4", now).expect("the fifth fits");
        assert!(admit(&mut new, "r5", now).is_err(), "the sixth does not");
    }

    /// Cost comes from the model's price when the agent reports none.
    #[test]
    fn cost_is_priced_by_model_when_not_reported() {
        let now = t("2026-12-02T10:20:00Z");
        let mut prices = BTreeMap::new();
        prices.insert("m".to_string(), Price { input_per_1k: 1.0, output_per_1k: 2.0, cache_read_per_1k: None });
        let mut run = RunRecord::pending("r".into(), "t", "ag", TriggerKind::Manual, now, now);
        let a = crate::model::Attempt::default();
        run.attempts.push(crate::model::Attempt { usage: Some(usage(1000, 500, 0.0)), model: Some("m".into()), ..a.clone() });
        run.attempts.push(crate::model::Attempt { usage: Some(usage(1000, 0, 0.5)), model: Some("m".into()), ..a });
        let amount = run_amount(&run, &prices);
        assert_eq!(amount, Amount { cost: 2.0 + 0.5, input_tokens: 2000, output_tokens: 500, runs: 1 });
    }

    /// The run crossing the soft limit notifies once; later ones do not.
    #[test]
    fn the_soft_limit_notifies_once_per_window() {
        let now = t("2026-12-02T10:20:00Z");
        let mut b = policy(LimitsSpec { runs: Some(4), ..Default::default() }, OnExceeded::Skip);
        let mut notes = Vec::new();
        for i in 0..4 {
            let id = format!("r{i}");
            admit(&mut b, &id, now).expect("admitted");
            let w = finish(&mut b, &id, now, usage(0, 0, 0.0));
            notes.push(w.iter().filter(|w| matches!(w, Write::Op(StoreOp::PutNotification(_)))).count());
        }
        // 50% of 4 is crossed by the second run.
        assert_eq!(notes, vec![0, 1, 0, 0]);
    }

    /// Issue 34, finding 3: `cost: 1.0`, runs costing 0.25, 20 runs of a
    /// task with no history admitted at once were all dispatched (5.00
    /// spent: nothing could be estimated, so nothing was reserved). Now the
    /// first goes as the window's probe, the others wait for it to settle,
    /// then are estimated from it: three more fit, the rest are SKIPPED
    /// without having run — 1.00 spent, at most the limit plus one run.
    #[test]
    fn a_new_tasks_first_burst_waits_for_a_probe_and_stays_within_the_limit() {
        let now = t("2026-12-02T10:20:00Z");
        let mut b = policy(LimitsSpec { cost: Some(1.0), ..Default::default() }, OnExceeded::Skip);
        let task = task();
        let mut runs: Vec<RunRecord> = (0..20)
            .map(|i| {
                let id = format!("r{i}");
                let mut run = RunRecord::pending(id.clone(), "t", "ag", TriggerKind::Manual, now, now);
                run.charges = admit(&mut b, &id, now).expect("admitted: nothing known refuses it");
                assert!(run.charges[0].unknown);
                run
            })
            .collect();
        // One dispatch pass: the first goes, the others wait for it.
        let mut went = Vec::new();
        for run in &mut runs {
            let q = DispatchQuery { now, run, task: &task, live_agents: 0 };
            match b.dispatch(&q) {
                Dispatch::Pass => {
                    let w = b.dispatched(&q, "e");
                    assert!(w.is_empty(), "still unknown: nothing to estimate yet");
                    run.attempts.push(crate::model::Attempt::default());
                    went.push(run.run_id.clone());
                }
                Dispatch::Wait { reason, .. } => assert_eq!(reason, "budget b: waiting for run r0 to settle, to estimate what a run costs"),
                d => panic!("{d:?}"),
            }
        }
        assert_eq!(went, vec!["r0"]);
        finish(&mut b, "r0", now, usage(0, 0, 0.25));
        // The next pass: estimated at 0.25 each, three fit the 0.75 left.
        let (mut dispatched, mut skipped) = (0, 0);
        for run in runs.iter_mut().skip(1) {
            let q = DispatchQuery { now, run, task: &task, live_agents: 0 };
            match b.dispatch(&q) {
                Dispatch::Pass => {
                    let w = b.dispatched(&q, "e");
                    match &w[..] {
                        [Write::Charges(c)] => assert!(!c[0].unknown && c[0].reserved.cost == 0.25, "{c:?}"),
                        w => panic!("{w:?}"),
                    }
                    dispatched += 1;
                }
                Dispatch::Skip { reason, why } => {
                    assert_eq!(reason, SkipReason::BudgetExceeded);
                    assert!(why.contains("budget b exceeded: cost 1.0000/1 used or reserved"), "{why}");
                    run.status = RunStatus::Skipped;
                    b.run_changed(run);
                    skipped += 1;
                }
                d => panic!("{d:?}"),
            }
        }
        assert_eq!((dispatched, skipped), (3, 16));
        for i in 1..=3 {
            finish(&mut b, &format!("r{i}"), now, usage(0, 0, 0.25));
        }
        let snap = &b.views(now)[0];
        assert_eq!((snap.used.cost, snap.used.runs, snap.reserved.runs), (1.0, 4, 0));
        assert_eq!(snap.state, "exceeded");
    }

    /// Issue 34, finding 12: every slot was SKIPPED `budget_exceeded` while
    /// `budgets list` said `soft` (what was used was under the limit, the
    /// next run's estimate did not fit); the budget's zone is shown.
    #[test]
    fn a_window_that_refuses_runs_reads_exceeded() {
        let now = t("2026-12-02T10:20:00Z");
        let mut b = policy(LimitsSpec { cost: Some(1.0), ..Default::default() }, OnExceeded::Skip);
        admit(&mut b, "r0", now).expect("admitted");
        finish(&mut b, "r0", now, usage(0, 0, 0.6));
        assert_eq!(b.views(now)[0].state, "soft");
        assert!(admit(&mut b, "r1", now).is_err(), "0.6 more does not fit");
        let snap = &b.views(now)[0];
        assert_eq!(snap.state, "exceeded");
        assert_eq!(snap.timezone, "UTC");
    }
}
