//! The run lifecycle after admission (`admission.rs`): dispatch in
//! priority order, attempts and how they end, retries, the start timeout,
//! cancellation, and the one function that ends a run ([`EngineCore::finish`]).
//!
//! Concurrency counts agents, not records: a run holds a slot of its task
//! while it has an open attempt, or an attempt the control plane ended
//! (cancel, deadline backstop) whose runner has not yet confirmed the agent
//! gone ([`crate::model::Attempt::awaiting_runner`]).

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};

use crate::clock::Now;

use super::policy::{AfterAttempt, AgentOutcome, AttemptQuery, Dispatch, DispatchQuery, FinishQuery, Write};
use super::writes::Home;
use super::{EngineCore, ReadPurpose, Reply, ReplyId, Timer, Triggered, Urgency};
use crate::dispatch::queue::ReadyKey;
use crate::engine::lifecycle::Lifecycle;
use crate::engine::protocol::{Assignment, ToRunner};
use crate::error::{Error, Result};
use crate::model::notification::NotifyEvent;
use crate::model::run::{MAX_FREE_INTERRUPTIONS, Outcome};
use crate::model::task::DEFAULT_START_TIMEOUT_SECONDS;
use crate::model::{Attempt, RunRecord, RunStatus};

/// Runs whose pending reason one dispatch pass refreshes in an agent's
/// queue when no runner serving the agent has a free slot.
const REASONS_PER_PASS: usize = 16;

/// One agent's queue in a dispatch pass.
struct AgentWalk {
    agent_id: String,
    cursor: Option<ReadyKey>,
    /// Selectors no runner could take this pass.
    no_runner: HashSet<Vec<(String, String)>>,
    looked_without_runner: usize,
}

impl AgentWalk {
    fn new(agent_id: String) -> AgentWalk {
        AgentWalk { agent_id, cursor: None, no_runner: HashSet::new(), looked_without_runner: 0 }
    }
}

/// Pause before a refused or never-started run may be assigned again.
const REQUEUE_PAUSE: chrono::Duration = chrono::Duration::seconds(1);

/// How an attempt ended, as the engine records it.
#[derive(Debug, Clone, Default)]
pub(super) struct AttemptEnd {
    pub outcome: Option<Outcome>,
    pub error: Option<String>,
    pub exit_code: Option<i32>,
    pub result: Option<serde_json::Value>,
    pub stdout_tail: Option<String>,
    pub stderr_tail: Option<String>,
    pub started_at: Option<DateTime<Utc>>,
    /// When the runner says the agent ended (UTC); `None`: the control
    /// plane decided the end now. Kept within `[start or dispatch, now]`,
    /// so a runner's clock cannot move it outside what this leader saw.
    pub finished_at: Option<DateTime<Utc>>,
    /// The control plane ended it without the runner confirming the agent
    /// is gone: it keeps holding its slots until the runner reports or is lost.
    pub awaiting_runner: bool,
    /// The runner's class of the end (`oom_killed`), when the agent names none.
    pub class: Option<String>,
    /// What the execution used, from its cgroup.
    pub machine: Option<crate::model::run::MachineUse>,
}

impl AttemptEnd {
    /// An end decided by the control plane.
    pub(super) fn presumed(outcome: Outcome, error: impl Into<String>, awaiting_runner: bool) -> Self {
        AttemptEnd { outcome: Some(outcome), error: Some(error.into()), awaiting_runner, ..Default::default() }
    }
}

impl EngineCore {
    fn start_timeout(&self, task_id: &str) -> chrono::Duration {
        let s = self.tasks.get(task_id).map_or(DEFAULT_START_TIMEOUT_SECONDS, |t| t.record.spec.execution.start_timeout_seconds);
        chrono::Duration::seconds(s)
    }

    /// Agents of a task alive or not confirmed gone (open attempts and
    /// attempts awaiting their runner).
    pub(super) fn live_agents(&self, task_id: &str) -> usize {
        self.counts.live(task_id)
    }

    /// Adds a new record to memory and to this turn's creations.
    pub(super) fn create(&mut self, now: Now, mut run: RunRecord) {
        // A record of its own: the task's skipped slots no longer chain.
        if let Some(e) = self.tasks.get_mut(&run.task_id) {
            e.skips = None;
        }
        run.fencing_token = self.cfg.token;
        run.updated_at = now.wall;
        if run.span_id.is_empty() {
            let (trace_id, span_id) = crate::model::trace::run_ids(&run.run_id, now.wall.timestamp_nanos_opt().unwrap_or_default());
            if run.trace_id.is_empty() {
                run.trace_id = trace_id;
            }
            run.span_id = span_id;
        }
        let id = run.run_id.clone();
        // Where its record is written: a slot with its task's cursor, a
        // follower with the end of the run it follows, an event's alone.
        let home = if run.trigger.is_slot() {
            Home::Task
        } else if let Some(up) = run.upstream.as_ref().filter(|_| run.rerun_of.is_none()) {
            // (A re-run of a follower carries its upstream but is made
            // alone, long after that run ended.)
            Home::With(up.run_id.clone())
        } else {
            Home::Own
        };
        self.remember_run(run);
        self.writes.created(&id, home);
    }

    /// Makes a PENDING run (no open attempt) wait for dispatch: a timer
    /// while its `next_attempt_at` is ahead — on the wall clock for a
    /// delay the caller named (`elapsed` false: a `not_before` is a time of
    /// day), on elapsed time for a pause (`elapsed` true) — else the ready
    /// queue, with its start deadline. The start timeout counts from when
    /// the run may first be dispatched, on elapsed time; `start_by` shows
    /// it on the wall clock.
    pub(super) fn make_ready(&mut self, now: Now, run_id: &str, elapsed: bool) {
        let start_timeout =
            self.run_task(run_id).map(|t| self.start_timeout(&t)).unwrap_or(chrono::Duration::seconds(DEFAULT_START_TIMEOUT_SECONDS));
        let Some(run) = self.runs.get_mut(run_id) else { return };
        if run.awaiting_admission
            && let Some(at) = run.next_attempt_at
        {
            // Admission first, even when due already (a new leader loading it).
            self.timers.push_wall(at, Timer::RunDue { run_id: run_id.to_string(), at });
            return;
        }
        if let Some(at) = run.next_attempt_at.filter(|t| *t > now.wall) {
            let timer = Timer::RunDue { run_id: run_id.to_string(), at };
            if elapsed {
                self.timers.push_mono(now.mono_at(at), timer)
            } else {
                self.timers.push_wall(at, timer)
            }
            return;
        }
        let start_by = *run.start_by.get_or_insert_with(|| now.wall.checked_add_signed(start_timeout).unwrap_or(DateTime::<Utc>::MAX_UTC));
        let (priority, scheduled_at, agent_id) = (run.priority, run.scheduled_at, run.agent_id.clone());
        self.ready.insert(run_id, &agent_id, priority, scheduled_at);
        self.dispatch_needed = true;
        self.timers.start_by.set(run_id.to_string(), now.mono_at(start_by));
    }

    fn run_task(&self, run_id: &str) -> Option<String> {
        self.runs.get(run_id).map(|r| r.task_id.clone())
    }

    /// The answer to a read the core asked for.
    pub(super) fn on_run_loaded(&mut self, now: Now, run_id: &str, stored: Option<RunRecord>, purpose: ReadPurpose) {
        match purpose {
            ReadPurpose::Trigger { reply, req } => match stored {
                Some(run) => {
                    let t = Triggered { run_id: run_id.to_string(), scheduled_at: run.scheduled_at, created: false };
                    self.fx.replies.push((reply, Reply::Trigger(Ok(t))));
                }
                None => self.trigger(now, reply, req, false),
            },
            ReadPurpose::Cancel { reply } => {
                let r = match (self.runs.get(run_id), stored) {
                    (Some(_), _) => self.cancel(now, run_id, "cancelled by user").map(Box::new),
                    (None, Some(run)) => Err(Error::FailedPrecondition(format!("run {run_id} is already {}", run.status.as_str()))),
                    (None, None) => Err(Error::NotFound { kind: "run", id: run_id.to_string() }),
                };
                self.fx.replies.push((reply, Reply::Cancel(r)));
            }
            ReadPurpose::LateReport { runner_id, session, report } => self.late_report_loaded(now, &runner_id, session, stored, *report),
            ReadPurpose::PastOnce { task_id, at } => self.past_once_loaded(now, &task_id, at, stored.is_some()),
            ReadPurpose::Backfill { id, slot, slot_run } => self.backfill_read(now, &id, slot, slot_run, run_id, stored),
        }
    }

    /// Assigns every ready run that has concurrency room and a runner, in
    /// one order across agents: highest priority first, then oldest slot
    /// (a k-way merge of the agents' queues, so a resource shared by
    /// several agents goes to the run that is first overall). An agent's
    /// queue is walked only while some runner serving it has a free slot;
    /// runs that cannot go get a pending reason (persisted lazily); with no
    /// free runner, only the first few of an agent's are looked at.
    pub(super) fn dispatch(&mut self, now: Now) {
        if !self.dispatch_needed {
            return;
        }
        self.dispatch_needed = false;
        let mut live: HashMap<String, usize> = HashMap::new();
        let mut walks: Vec<AgentWalk> = self.ready.agents().into_iter().map(AgentWalk::new).collect();
        let mut heads: std::collections::BTreeMap<ReadyKey, usize> = std::collections::BTreeMap::new();
        for (i, w) in walks.iter().enumerate() {
            if let Some(key) = self.ready.next_after(&w.agent_id, None) {
                heads.insert(key, i);
            }
        }
        while let Some((key, i)) = heads.pop_first() {
            let w = &mut walks[i];
            if !self.dispatch_one(now, w, &key, &mut live) {
                continue;
            }
            w.cursor = Some(key);
            if let Some(next) = self.ready.next_after(&w.agent_id, w.cursor.as_ref()) {
                heads.insert(next, i);
            }
        }
        for (resource, seconds) in self.policies.resources.take_waited() {
            self.fx.events.push(Lifecycle::ResourceWaited { resource, seconds });
        }
    }

    /// One ready run asks the policies whether it may go now (the second
    /// decision point), then for a runner. `false`: its agent's walk ends
    /// here (no free runner, and enough reasons given this pass).
    fn dispatch_one(&mut self, now: Now, walk: &mut AgentWalk, key: &ReadyKey, live: &mut HashMap<String, usize>) -> bool {
        let agent_id = walk.agent_id.as_str();
        if !self.registry.any_free(agent_id) {
            if walk.looked_without_runner >= REASONS_PER_PASS {
                return false;
            }
            walk.looked_without_runner += 1;
        }
        let run_id = key.run_id.clone();
        let Some(run) = self.runs.get(&run_id) else {
            self.ready.remove(&run_id);
            return true;
        };
        let task_id = run.task_id.clone();
        let Some(task) = self.tasks.get(&task_id) else {
            self.finish(now, &run_id, RunStatus::Cancelled, "task was deleted before the run started".into());
            return true;
        };
        let live_agents = match live.get(&task_id) {
            Some(n) => *n,
            None => {
                let n = self.live_agents(&task_id);
                live.insert(task_id.clone(), n);
                n
            }
        };
        let q = DispatchQuery { now: now.wall, run, task: &task.record.spec, live_agents };
        let reason = match self.policies.dispatch(&q) {
            Dispatch::Skip { reason, why } => {
                self.skip_pending(now, &run_id, reason, why);
                return true;
            }
            Dispatch::Wait { reason, until } => {
                if let Some(at) = until {
                    self.timers.wake_at(now.mono_at(at));
                }
                reason
            }
            Dispatch::Pass => {
                let selector = task.record.spec.execution.selector.as_ref().map(|s| s.labels.clone()).unwrap_or_default();
                let sel_key: Vec<(String, String)> = selector.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                if walk.no_runner.contains(&sel_key) {
                    self.registry.waiting_reason(agent_id, &selector)
                } else {
                    match self.registry.choose(agent_id, &selector) {
                        Some(runner_id) => {
                            self.assign(now, &run_id, &runner_id);
                            *live.entry(task_id).or_default() += 1;
                            return true;
                        }
                        None => {
                            walk.no_runner.insert(sel_key);
                            self.registry.waiting_reason(agent_id, &selector)
                        }
                    }
                }
            }
        };
        if let Some(run) = self.runs.get_mut(&run_id)
            && run.pending_reason.as_deref() != Some(reason.as_str())
        {
            run.pending_reason = Some(reason);
            self.touch(now, &run_id, Urgency::Lazy);
        }
        true
    }

    fn context_json(&self, run: &RunRecord, execution_id: &str, attempt: u32) -> String {
        let mut ctx = self.tasks.get(&run.task_id).map(|t| t.record.spec.context.clone()).unwrap_or_default();
        ctx.insert("task_id".into(), run.task_id.clone().into());
        ctx.insert("run_id".into(), run.run_id.clone().into());
        ctx.insert("execution_id".into(), execution_id.into());
        ctx.insert("attempt".into(), attempt.into());
        ctx.insert("scheduled_at".into(), run.scheduled_at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true).into());
        ctx.insert("trigger".into(), run.trigger.as_str().into());
        ctx.insert("params".into(), serde_json::Value::Object(run.params.clone()));
        ctx.insert("checkpoint".into(), run.progress.as_ref().and_then(|p| p.checkpoint.clone()).unwrap_or(serde_json::Value::Null));
        // A body stored beside the run is put in by the shell at dispatch
        // (`Assignment::stored_event_body`).
        if let Some(ev) = &run.event {
            let mut v = serde_json::to_value(ev).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.remove("body_stored");
                o.entry("body").or_insert(serde_json::Value::Null);
            }
            ctx.insert("event".into(), v);
        }
        if let Some(up) = &run.upstream {
            ctx.insert("upstream".into(), serde_json::to_value(up).unwrap_or_default());
        }
        serde_json::Value::Object(ctx).to_string()
    }

    /// A new attempt of `run_id` on `runner_id`: RUNNING from here (the
    /// runner's `Started` only adds the start time).
    fn assign(&mut self, now: Now, run_id: &str, runner_id: &str) {
        let Some(run) = self.runs.get(run_id) else { return };
        let task_id = run.task_id.clone();
        let timeout_s = self.tasks.get(&run.task_id).map_or(3600, |t| t.record.spec.execution.timeout_seconds.max(1));
        self.ids.execution += 1;
        let execution_id = execution_id(run_id, run.attempt_count() as usize, self.cfg.token, now.wall, self.ids.execution);
        let attempt = run.attempt_count().saturating_add(1);
        let context_json = self.context_json(run, &execution_id, attempt);
        let instance = self.registry.get(runner_id).map(|r| r.instance_id.clone()).unwrap_or_default();
        let timeout = chrono::Duration::seconds(timeout_s);
        let deadline = now.wall.checked_add_signed(timeout).unwrap_or(DateTime::<Utc>::MAX_UTC);
        let Some(run) = self.runs.get_mut(run_id) else { return };
        run.attempts.push(Attempt {
            attempt,
            execution_id: execution_id.clone(),
            runner_id: runner_id.to_string(),
            runner_instance: instance,
            dispatched_at: now.wall,
            started_at: None,
            finished_at: None,
            outcome: None,
            error: None,
            exit_code: None,
            awaiting_runner: false,
            report: None,
            usage: None,
            ..Default::default()
        });
        run.status = RunStatus::Running;
        // The run's first dispatch (each attempt keeps its own), as
        // `actual_started_at` is its first start (issue 19: a retried run
        // showed the last attempt's dispatch beside the first's start).
        run.dispatched_at.get_or_insert(now.wall);
        run.pending_reason = None;
        run.next_attempt_at = None;
        // `start_by` stays until the agent starts: a refused assignment
        // goes back to waiting under the same start deadline.
        let assignment = Assignment {
            run_id: run.run_id.clone(),
            execution_id: execution_id.clone(),
            attempt,
            task_id: run.task_id.clone(),
            agent_id: run.agent_id.clone(),
            context_json,
            checkpoint_json: run.progress.as_ref().and_then(|p| p.checkpoint.as_ref()).map(|c| c.to_string()).unwrap_or_default(),
            deadline,
            timeout_seconds: timeout_s as u64,
            fencing_token: self.cfg.token,
            scheduled_at: run.scheduled_at,
            trace_id: run.trace_id.clone(),
            span_id: if run.trace_id.is_empty() { String::new() } else { crate::model::trace::attempt_span_id(&execution_id) },
            trace_state: run.trace_state.clone(),
            baggage: run.baggage.clone(),
            stored_event_body: run.event.as_ref().is_some_and(|e| e.body_stored),
            limits: self.tasks.get(&run.task_id).and_then(|t| t.record.spec.execution.limits),
        };
        if let (Some(run), Some(task)) = (self.runs.get(run_id), self.tasks.get(&task_id)) {
            let q = DispatchQuery { now: now.wall, run, task: &task.record.spec, live_agents: 0 };
            let taken = self.policies.dispatched(&q, &execution_id);
            if let Some(run) = self.runs.get_mut(run_id) {
                for w in taken {
                    match w {
                        Write::Holds(holds) => {
                            if let Some(a) = run.current_attempt_mut() {
                                a.holds.extend(holds);
                            }
                        }
                        // Estimated at dispatch: replaces what admission reserved.
                        Write::Charges(charges) => {
                            run.charges.retain(|c| !charges.iter().any(|n| n.budget == c.budget && n.window_start == c.window_start));
                            run.charges.extend(charges);
                        }
                        _ => {}
                    }
                }
            }
        }
        self.ready.remove(run_id);
        self.timers.start_by.remove(&run_id.to_string());
        if let Some(r) = self.registry.get_mut(runner_id) {
            r.running.insert(execution_id.clone(), run_id.to_string());
        }
        self.touch(now, run_id, Urgency::Now);
        let slack = Self::dur(self.timing().deadline_slack());
        // The backstop counts elapsed time from the dispatch.
        self.timers.attempt_deadlines.set((run_id.to_string(), execution_id.clone()), now.mono.after(timeout + slack));
        self.send(runner_id, ToRunner::Assign(Box::new(assignment)));
        // Per-run lines are debug (issue 38: six info lines a run cost more
        // than the run); the trace and the metrics carry them.
        tracing::debug!(run_id, runner_id, execution_id = %execution_id, attempt, "assigned");
        if let Some(r) = self.event_run(run_id) {
            self.fx.events.push(Lifecycle::RunDispatched { run: r, runner_id: runner_id.to_string(), execution_id, attempt });
        }
    }

    /// The third decision point: the open attempt `execution_id` of a run
    /// ended. The agent's word (its result's outcome contract) refines
    /// what its runner reported; the policies decide what follows:
    /// SUCCEEDED, CANCELLED, PENDING again (interrupted), RETRYING (with
    /// backoff, or until the agent's `retry_at`) or FAILED/TIMEOUT.
    /// No-op if that attempt is not open.
    pub(super) fn end_attempt(&mut self, now: Now, run_id: &str, execution_id: &str, end: AttemptEnd) {
        let Some(run) = self.runs.get(run_id) else { return };
        if run.current_execution() != Some(execution_id) {
            return;
        }
        let Some(reported) = end.outcome else { return };
        self.timers.attempt_deadlines.remove(&(run_id.to_string(), execution_id.to_string()));
        if !end.awaiting_runner {
            self.registry.release(execution_id);
        }
        let agent = AgentOutcome::parse(end.result.as_ref(), now.wall, self.policies.retry.max_hold);
        let outcome = agent.refine(reported);
        let Some(run) = self.runs.get_mut(run_id) else { return };
        // A start the runner's Started did not tell (lost, or a runner that
        // reports it only with Finished) is announced here.
        let start_learned = end.started_at.is_some() && run.current_attempt().is_some_and(|a| a.started_at.is_none());
        // The agent's exit as its runner reports it, not this leader's
        // receipt (issue 34: a report re-sent to a new leader after a
        // failover made a 1.3 s run read 6.6 s).
        let ended_at = match (end.finished_at, run.current_attempt()) {
            (Some(t), Some(a)) => t.clamp(end.started_at.or(a.started_at).unwrap_or(a.dispatched_at).min(now.wall), now.wall),
            _ => now.wall,
        };
        if let Some(a) = run.current_attempt_mut() {
            a.finished_at = Some(ended_at);
            a.outcome = Some(outcome);
            a.error = end.error.clone();
            a.exit_code = end.exit_code;
            a.awaiting_runner = end.awaiting_runner;
            a.usage = end.result.as_ref().and_then(crate::model::run::Usage::from_result);
            a.model = end.result.as_ref().and_then(crate::model::run::model_of);
            // The cost a budget charges, on the attempt too (issue 34: it
            // read 0.0 while the budget charged the price table's 0.011).
            if let Some(u) = a.usage.as_mut()
                && let Some(cost) = self.policies.budgets.price(a.model.as_deref(), u)
            {
                u.cost = cost;
                u.cost_priced = true;
            }
            a.class = agent.class.clone().or(end.class);
            a.machine = end.machine;
            a.resource = agent.resource.clone();
            a.retry_at = agent.retry_at.filter(|_| outcome == Outcome::RateLimited);
            if a.started_at.is_none() {
                a.started_at = end.started_at;
            }
        }
        if let Some(t) = end.started_at {
            run.actual_started_at.get_or_insert(t);
        }
        run.error = end.error.clone();
        if end.result.is_some() {
            run.result = end.result;
        }
        if let Some(s) = end.stdout_tail {
            run.stdout_tail = s;
        }
        if let Some(s) = end.stderr_tail {
            run.stderr_tail = s;
        }
        // What watchers see is what is stored: trimmed here, not only in
        // the write.
        if let Err(e) = crate::repo::trim_run(run) {
            tracing::error!(run_id, error = %e, "cannot measure a run record");
        }
        self.dispatch_needed = true;
        let class = run.attempts.last().and_then(|a| a.class.clone()).unwrap_or_default();
        if outcome == Outcome::Succeeded {
            tracing::debug!(run_id, execution_id, outcome = outcome.as_str(), class, "attempt ended");
        } else {
            tracing::info!(run_id, execution_id, outcome = outcome.as_str(), class, "attempt ended");
        }
        if start_learned {
            self.fx.events.push(Lifecycle::RunStarted(std::sync::Arc::new(run.clone())));
        }
        let task = self.tasks.get(&run.task_id).map(|e| &e.record.spec);
        let q = AttemptQuery { now: now.wall, run, task, outcome, agent: &agent, error: end.error.as_deref() };
        let (next, writes) = self.policies.attempt_ended(&q);
        self.attempt_event(run_id, execution_id, outcome);
        self.apply_writes(now, run_id, writes);
        match next {
            AfterAttempt::Finish { status, why } => self.finish_at(now, run_id, status, why, ended_at),
            AfterAttempt::Requeue => {
                // Not the agent's failure: dispatched again, no attempt spent.
                let Some(run) = self.runs.get_mut(run_id) else { return };
                run.interruptions = run.interruptions.saturating_add(1);
                run.status = RunStatus::Pending;
                run.start_by = None;
                let n = run.interruptions;
                run.pending_reason = Some(format!("interrupted ({n} of {MAX_FREE_INTERRUPTIONS} free); waiting for dispatch"));
                self.touch(now, run_id, Urgency::Now);
                self.make_ready(now, run_id, true);
            }
            AfterAttempt::RetryAt { at, counted } => {
                let Some(run) = self.runs.get_mut(run_id) else { return };
                run.status = RunStatus::Retrying;
                run.next_attempt_at = Some(at);
                run.start_by = None;
                let when = at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
                run.pending_reason = Some(if counted {
                    format!("retrying at {when} (attempt {} failed)", run.attempt_count())
                } else {
                    let by = agent.resource.as_deref().map(|r| format!(" by {r}")).unwrap_or_default();
                    format!("rate limited{by}: retrying at {when} (not counted against max_retries)")
                });
                tracing::info!(run_id, outcome = outcome.as_str(), counted, retry_at = %at, "attempt ended; retrying");
                self.touch(now, run_id, Urgency::Now);
                // The backoff is elapsed time.
                self.timers.push_mono(now.mono_at(at), Timer::RunDue { run_id: run_id.to_string(), at });
            }
            AfterAttempt::Pass => {
                tracing::error!(run_id, "no policy decided after an attempt; the run fails");
                self.finish(now, run_id, RunStatus::Failed, "internal: no policy decided".into());
            }
        }
    }

    fn attempt_event(&mut self, run_id: &str, execution_id: &str, outcome: Outcome) {
        if let Some(r) = self.event_run(run_id) {
            self.fx.events.push(Lifecycle::AttemptEnded { run: r, execution_id: execution_id.to_string(), outcome });
        }
    }

    /// Ends a run: the one place a run becomes SUCCEEDED, FAILED, TIMEOUT or
    /// CANCELLED. Terminal is final: a run already terminal is left as it is.
    pub(super) fn finish(&mut self, now: Now, run_id: &str, status: RunStatus, error: String) {
        self.finish_at(now, run_id, status, error, now.wall);
    }

    /// [`EngineCore::finish`], ended at `at` (the ended attempt's end as its
    /// runner reported it; `now` for an end the control plane decides).
    pub(super) fn finish_at(&mut self, now: Now, run_id: &str, status: RunStatus, error: String, at: DateTime<Utc>) {
        debug_assert!(status.is_terminal() && status != RunStatus::Skipped);
        let Some(run) = self.runs.get_mut(run_id) else { return };
        if run.status.is_terminal() {
            return;
        }
        run.status = status;
        run.finished_at = Some(at.min(now.wall));
        run.next_attempt_at = None;
        run.pending_reason = None;
        run.start_by = None;
        if !error.is_empty() {
            run.error = Some(error);
        }
        let task_id = run.task_id.clone();
        self.ready.remove(run_id);
        self.timers.start_by.remove(&run_id.to_string());
        self.dispatch_needed = true;
        self.touch(now, run_id, Urgency::Now);
        if status == RunStatus::Succeeded {
            tracing::debug!(run_id, status = status.as_str(), "run finished");
        } else {
            tracing::info!(run_id, status = status.as_str(), "run finished");
        }
        if let Some(r) = self.event_run(run_id) {
            self.fx.events.push(Lifecycle::RunFinished(r));
        }
        if let Some(event) = NotifyEvent::for_status(status) {
            self.notify(now, run_id, event, None);
        }
        // The last decision point: each policy settles what the run held.
        let Some(run) = self.runs.get(run_id) else { return };
        let entry = self.tasks.get(&task_id);
        let breaker = entry.and_then(|e| e.cursor.as_ref()?.breaker.clone());
        let q = FinishQuery { now: now.wall, run, task: entry.map(|e| &e.record.spec), breaker: breaker.as_ref() };
        let writes = self.policies.finished(&q);
        self.apply_writes(now, run_id, writes);
    }

    /// Undoes the run's open attempt if it never started on its runner (the
    /// runner refused it, or the same runner process reconnected without
    /// it): no attempt ran, so none is spent. PENDING again after a short
    /// pause. Returns false, changing nothing, when it started.
    pub(super) fn requeue_unstarted(&mut self, now: Now, run_id: &str, execution_id: &str, why: String) -> bool {
        let Some(run) = self.runs.get_mut(run_id) else { return false };
        if !run.current_attempt().is_some_and(|a| a.execution_id == execution_id && a.started_at.is_none()) {
            return false;
        }
        run.attempts.pop();
        run.status = RunStatus::Pending;
        run.next_attempt_at = Some(now.wall + REQUEUE_PAUSE);
        run.pending_reason = Some(why);
        if run.attempts.is_empty() {
            run.dispatched_at = None;
        }
        self.registry.release(execution_id);
        self.touch(now, run_id, Urgency::Now);
        self.make_ready(now, run_id, true);
        true
    }

    /// A retry's backoff elapsed, or a delayed or requeued run's time
    /// came: the run is ready if it still waits for `at` (a timer of an
    /// earlier wait is stale).
    pub(super) fn on_run_due(&mut self, now: Now, run_id: &str, at: DateTime<Utc>) {
        let Some(run) = self.runs.get_mut(run_id) else { return };
        if run.status.is_terminal() || run.current_attempt().is_some() || run.next_attempt_at != Some(at) {
            return;
        }
        if run.status == RunStatus::Retrying {
            run.status = RunStatus::Pending;
        }
        if run.awaiting_admission {
            self.admit_due(now, run_id);
            return;
        }
        run.next_attempt_at = None;
        self.touch(now, run_id, Urgency::Lazy);
        self.make_ready(now, run_id, true);
    }

    /// `execution.start_timeout_seconds`: a run not dispatched by its
    /// `start_by` ends TIMEOUT, freeing its slot; retries do not apply.
    pub(super) fn on_start_by(&mut self, now: Now, run_id: &str) {
        let Some(run) = self.runs.get(run_id) else { return };
        // The deadline (elapsed time) passed: `start_by` is its wall clock view.
        let due = run.status == RunStatus::Pending && run.current_attempt().is_none() && run.start_by.is_some();
        if !due {
            return;
        }
        let secs = self.tasks.get(&run.task_id).map_or(DEFAULT_START_TIMEOUT_SECONDS, |t| t.record.spec.execution.start_timeout_seconds);
        let reason = run.pending_reason.clone().unwrap_or_else(|| "waiting for dispatch".into());
        tracing::warn!(run_id, reason = %reason, "run not started in time");
        self.finish(now, run_id, RunStatus::Timeout, format!("not started within {secs} s: {reason}"));
    }

    /// The control plane's own deadline for an attempt passed without a
    /// result: TIMEOUT, and the attempt holds its slots until the runner
    /// reports the agent gone or is lost.
    pub(super) fn on_deadline(&mut self, now: Now, run_id: &str, execution_id: &str) {
        let Some(run) = self.runs.get(run_id) else { return };
        if run.current_execution() != Some(execution_id) {
            return;
        }
        let runner_id = run.current_attempt().map(|a| a.runner_id.clone()).unwrap_or_default();
        self.send(
            &runner_id,
            ToRunner::Cancel { run_id: run_id.into(), execution_id: execution_id.into(), reason: "deadline passed".into() },
        );
        let slack = self.timing().deadline_slack().as_secs();
        let why = format!("no result from runner {runner_id} by {slack} s after the deadline");
        self.end_attempt(now, run_id, execution_id, AttemptEnd::presumed(Outcome::Timeout, why, true));
    }

    /// `CancelRun` from the API.
    pub(super) fn cancel_command(&mut self, now: Now, reply: ReplyId, run_id: &str, reason: &str) {
        let reason = if reason.is_empty() { "cancelled by user" } else { reason };
        if self.runs.get(run_id).is_some_and(|r| !r.status.is_terminal()) {
            let r = self.cancel(now, run_id, reason).map(Box::new);
            self.fx.replies.push((reply, Reply::Cancel(r)));
        } else {
            self.fx.reads.push((run_id.to_string(), ReadPurpose::Cancel { reply }));
        }
    }

    /// Cancels a run: at once if it has no open attempt; else its runner is
    /// told to stop the agent, and the attempt holds its slots until the
    /// runner reports it gone (the agent may take the kill grace to exit).
    pub(super) fn cancel(&mut self, now: Now, run_id: &str, reason: &str) -> Result<RunRecord> {
        let Some(run) = self.runs.get(run_id) else { return Err(Error::NotFound { kind: "run", id: run_id.to_string() }) };
        if run.status.is_terminal() {
            return Err(Error::FailedPrecondition(format!("run {run_id} is already {}", run.status.as_str())));
        }
        if let Some(a) = run.current_attempt() {
            let (runner_id, exec) = (a.runner_id.clone(), a.execution_id.clone());
            self.send(&runner_id, ToRunner::Cancel { run_id: run_id.into(), execution_id: exec.clone(), reason: reason.into() });
            self.end_attempt(now, run_id, &exec, AttemptEnd::presumed(Outcome::Cancelled, reason, true));
        } else {
            self.finish(now, run_id, RunStatus::Cancelled, reason.to_string());
        }
        tracing::info!(run_id, reason, "run cancelled");
        self.runs.get(run_id).cloned().ok_or_else(|| Error::Internal("cancelled run vanished".into()))
    }

    /// An attempt whose runner process may have been replaced by another
    /// (same runner id, new instance): once the old process's fence has
    /// passed, its agent is gone and the attempt stops holding a slot.
    pub(super) fn release_orphan(&mut self, now: Now, run_id: &str, execution_id: &str) {
        let Some(run) = self.runs.get_mut(run_id) else { return };
        let Some(a) = run.attempt_mut(execution_id) else { return };
        if !a.awaiting_runner {
            return;
        }
        a.awaiting_runner = false;
        self.registry.release(execution_id);
        self.dispatch_needed = true;
        self.touch(now, run_id, Urgency::Now);
    }

    /// Recovery at load: runs from the `active/` index get their timers;
    /// open attempts wait for their runner (a placeholder entry) to
    /// re-declare them.
    pub(super) fn recover_runs(&mut self, now: Now, runs: Vec<RunRecord>) {
        let slack = Self::dur(self.timing().deadline_slack());
        let wait = Self::dur(self.timing().redeclare_wait());
        for run in runs {
            let run_id = run.run_id.clone();
            for a in run.attempts.iter().filter(|a| a.is_open() || a.awaiting_runner) {
                let entry = self.registry.entry_or_placeholder(&a.runner_id, now);
                entry.running.insert(a.execution_id.clone(), run_id.clone());
            }
            let open = run.current_attempt().map(|a| (a.execution_id.clone(), a.dispatched_at));
            let terminal = run.status.is_terminal();
            let next = run.next_attempt_at;
            let pending = run.status == RunStatus::Pending;
            self.remember_run(run);
            if terminal {
                continue;
            }
            if let Some((exec, dispatched_at)) = open {
                let timeout_s = self
                    .runs
                    .get(&run_id)
                    .map(|r| r.task_id.clone())
                    .and_then(|t| self.tasks.get(&t))
                    .map_or(3600, |t| t.record.spec.execution.timeout_seconds);
                let deadline = dispatched_at
                    .checked_add_signed(chrono::Duration::seconds(timeout_s.min(i64::MAX / 1000)) + slack)
                    .unwrap_or(DateTime::<Utc>::MAX_UTC);
                // Never before the runner had its chance to re-declare and report.
                let at = std::cmp::max(now.mono_at(deadline), now.mono.after(wait));
                self.timers.attempt_deadlines.set((run_id, exec), at);
            } else if next.is_some() || pending {
                let retrying = self.runs.get(&run_id).is_some_and(|r| r.status == RunStatus::Retrying);
                if next.is_none_or(|t| t <= now.wall)
                    && let Some(r) = self.runs.get_mut(&run_id)
                    && r.status == RunStatus::Retrying
                {
                    r.status = RunStatus::Pending;
                    r.next_attempt_at = None;
                }
                self.make_ready(now, &run_id, retrying);
            }
        }
    }
}

/// A new execution id: unique per attempt. Derived, not random, so the
/// core stays deterministic: the run, the attempt index, the term and the
/// instant and a per-term counter (UUID-shaped for the runner's
/// directories and logs). Ids are not secrets: ownership is checked by
/// runner id.
fn execution_id(run_id: &str, attempts: usize, token: u64, now: DateTime<Utc>, seq: u64) -> String {
    let mut h1: u64 = 0xcbf2_9ce4_8422_2325;
    let mut h2: u64 = 0x8422_2325_cbf2_9ce4;
    let mut mix = |bytes: &[u8]| {
        for b in bytes {
            h1 ^= u64::from(*b);
            h1 = h1.wrapping_mul(0x0100_0000_01b3);
            h2 = h2.rotate_left(5) ^ u64::from(*b);
            h2 = h2.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    };
    mix(run_id.as_bytes());
    mix(&attempts.to_le_bytes());
    mix(&token.to_le_bytes());
    mix(&now.timestamp_nanos_opt().unwrap_or_default().to_le_bytes());
    mix(&seq.to_le_bytes());
    let b = ((h1 as u128) << 64) | h2 as u128;
    uuid::Uuid::from_u128(b).hyphenated().to_string()
}
