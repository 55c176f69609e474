//! Run lifecycle: admission under the overlap policy, dispatch to runners,
//! attempt outcomes, retries with backoff, deadlines and cancellation.

use chrono::{DateTime, Utc};

use punchclock_proto::v1::{Assign, Cancel, ControlMessage, Finished, Outcome, ProgressReport, Started, control_message};

use super::{Engine, Timer, TriggerRequest};
use crate::dispatch::backoff;
use crate::election::Leadership;
use crate::error::{Error, Result};
use crate::model::run::{manual_run_id, outcome, skip_reason};
use crate::model::task::OverlapPolicy;
use crate::model::{Attempt, Progress, RunRecord, RunStatus};
use crate::store::{Compare, Keys, KvStore, Txn, TxnOp};

/// Starts of a runner's `Finished.error` when it refused an assignment
/// without starting it (see `agent-runner` `session::start`).
const REFUSALS: [&str; 2] = ["no free slot", "runner is shutting down"];
/// Pause before a refused run may be assigned again.
const REQUEUE_PAUSE: chrono::Duration = chrono::Duration::seconds(1);

/// Start of the error of an attempt the control plane timed out itself.
const NO_RESULT: &str = "no result from runner";

/// Longest manual-trigger delay: one year.
pub const MAX_DELAY_SECONDS: u64 = 365 * 86_400;

/// How a finished attempt ended, as the engine records it.
pub(super) struct AttemptEnd {
    pub outcome: &'static str,
    pub error: Option<String>,
    pub exit_code: Option<i32>,
    pub result: Option<serde_json::Value>,
    pub stdout_tail: Option<String>,
    pub stderr_tail: Option<String>,
}

impl AttemptEnd {
    pub(super) fn simple(outcome: &'static str, error: impl Into<String>) -> Self {
        AttemptEnd { outcome, error: Some(error.into()), exit_code: None, result: None, stdout_tail: None, stderr_tail: None }
    }
}

fn ts(t: Option<&prost_types::Timestamp>) -> Option<DateTime<Utc>> {
    t.and_then(|t| DateTime::from_timestamp(t.seconds, t.nanos.max(0) as u32))
}

fn pts(t: DateTime<Utc>) -> prost_types::Timestamp {
    prost_types::Timestamp { seconds: t.timestamp(), nanos: t.timestamp_subsec_nanos() as i32 }
}

fn parse_json(s: &str) -> Option<serde_json::Value> {
    if s.is_empty() {
        return None;
    }
    Some(serde_json::from_str(s).unwrap_or_else(|_| serde_json::Value::String(s.to_string())))
}

impl Engine {
    /// If `f`'s execution is the run's latest attempt, ended `lost`, and the
    /// run has not moved on to another attempt, reopens that attempt (in
    /// memory) so its real outcome can be recorded. Returns whether it did.
    async fn revive_presumed_lost(&mut self, f: &Finished) -> bool {
        let run = match self.runs.get(&f.run_id) {
            Some(r) => Some(r.clone()),
            None => match self.store.get(&self.keys.run(&f.run_id)).await {
                Ok(Some(kv)) => serde_json::from_slice::<RunRecord>(&kv.value).ok(),
                _ => None,
            },
        };
        let Some(mut run) = run else { return false };
        // Presumptions of the control plane, not reports of the runner: lost
        // (runner silent) and the control plane's own deadline backstop.
        let presumed = |a: &Attempt| {
            a.outcome.as_deref() == Some(outcome::LOST)
                || (a.outcome.as_deref() == Some(outcome::TIMEOUT) && a.error.as_deref().is_some_and(|e| e.starts_with(NO_RESULT)))
        };
        let revivable = matches!(run.status, RunStatus::Retrying | RunStatus::Failed | RunStatus::Timeout)
            && run.attempts.last().is_some_and(|a| a.execution_id == f.execution_id && presumed(a));
        if !revivable {
            return false;
        }
        if let Some(a) = run.attempts.last_mut() {
            a.outcome = None;
            a.finished_at = None;
        }
        run.status = RunStatus::Running;
        run.finished_at = None;
        run.next_attempt_at = None;
        self.runs.insert(run.run_id.clone(), run);
        true
    }

    /// Undoes the run's latest attempt, `execution_id`, if it never started
    /// on its runner (the runner refused it, or reconnected without it and
    /// no Started was ever reported): no attempt ran, so none is spent. The
    /// run is PENDING again after a short pause (a full runner is not
    /// hammered). Returns false, changing nothing, when that attempt started.
    pub(super) async fn requeue_unstarted(&mut self, run_id: &str, execution_id: &str, why: impl FnOnce(&str) -> String) -> bool {
        let Some(mut run) = self.runs.get(run_id).cloned() else { return false };
        if !run.attempts.last().is_some_and(|a| a.execution_id == execution_id && a.started_at.is_none()) {
            return false;
        }
        for r in self.runners.values_mut() {
            r.running.remove(execution_id);
        }
        let runner = run.attempts.pop().map(|a| a.runner_id).unwrap_or_default();
        let at = self.now() + REQUEUE_PAUSE;
        run.status = RunStatus::Pending;
        run.next_attempt_at = Some(at);
        run.pending_reason = Some(why(&runner));
        if !self.save(run).await {
            return false;
        }
        self.push_timer(at, Timer::RunDue { run_id: run_id.to_string() });
        true
    }

    /// Adds the leader's fence to a transaction.
    pub(super) fn fenced(&self, mut txn: Txn) -> Txn {
        txn.compares.extend(self.leadership.fence.iter().cloned());
        txn
    }

    /// A fenced write failed: a newer leader exists. Stop acting as leader.
    pub(super) fn on_fenced(&mut self, what: &str) {
        tracing::error!(what, token = self.leadership.token, "leader write rejected by fencing token; stepping down");
        self.fenced = true;
        self.rx.close();
    }

    /// Writes a run under this leader's fence; see [`write_run`].
    pub(super) async fn store_run(&mut self, run: &mut RunRecord, create: bool) -> Result<bool> {
        self.store_run_with(run, create, Vec::new()).await
    }

    /// [`Engine::store_run`] with extra ops in the same transaction (a slot's
    /// record and the cursor that says it is handled commit together).
    pub(super) async fn store_run_with(&mut self, run: &mut RunRecord, create: bool, extra: Vec<TxnOp>) -> Result<bool> {
        let r = write_run(&*self.store, &self.keys, &self.leadership, self.clock.now(), run, create, extra).await;
        if matches!(r, Err(Error::Fenced(_))) {
            self.on_fenced("run write");
        }
        r
    }

    /// Persists a run already in memory; on success keeps the in-memory copy
    /// in step. Returns whether it was stored. A failed write leaves memory
    /// as it was, so memory never runs ahead of the store.
    async fn save(&mut self, mut run: RunRecord) -> bool {
        if let Err(e) = self.store_run(&mut run, false).await {
            tracing::error!(run_id = %run.run_id, error = %e, "cannot write run");
            return false;
        }
        if run.status.is_terminal() {
            self.runs.remove(&run.run_id);
        } else {
            self.runs.insert(run.run_id.clone(), run);
        }
        true
    }

    /// Creates a run under its task's overlap policy, then dispatches.
    /// Returns whether it was created (false: the slot was already taken).
    pub(super) async fn admit(&mut self, run: RunRecord) -> bool {
        self.admit_with(run, Vec::new()).await
    }

    /// [`Engine::admit`] with extra ops committed with the run's creation.
    pub(super) async fn admit_with(&mut self, mut run: RunRecord, extra: Vec<TxnOp>) -> bool {
        let now = self.now();
        if let Some(e) = self.tasks.get(&run.task_id) {
            let ex = &e.record.spec.execution;
            let (limit, policy) = (ex.concurrency_limit as usize, ex.overlap_policy);
            let mut active: Vec<(DateTime<Utc>, String)> = self
                .runs
                .values()
                // A manual run still waiting out its delay does not hold a slot.
                .filter(|r| r.task_id == run.task_id && r.run_id != run.run_id && !r.is_delayed(now))
                .map(|r| (r.scheduled_at, r.run_id.clone()))
                .collect();
            if active.len() >= limit {
                match policy {
                    OverlapPolicy::Skip => {
                        let slot = run.scheduled_at;
                        let msg =
                            format!("{} run(s) of the task still active (concurrency_limit {limit}, overlap_policy skip)", active.len());
                        run = RunRecord::skipped(
                            run.run_id,
                            &run.task_id,
                            &run.agent_id,
                            &run.trigger,
                            skip_reason::CONCURRENCY_LIMIT,
                            (1, slot, slot),
                            msg,
                            now,
                        );
                    }
                    OverlapPolicy::Queue => {
                        run.pending_reason = Some(format!("queued behind {} active run(s) (concurrency_limit {limit})", active.len()));
                    }
                    OverlapPolicy::CancelRunning => {
                        active.sort();
                        let excess = active.len() + 1 - limit;
                        for (_, old) in active.into_iter().take(excess) {
                            let reason = format!("cancelled for {} (overlap_policy cancel_running)", run.run_id);
                            if let Err(e) = self.cancel_run(&old, &reason).await {
                                tracing::warn!(run_id = %old, error = %e, "cannot cancel for overlap");
                            }
                        }
                    }
                }
            }
        }
        match self.store_run_with(&mut run, true, extra).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::debug!(run_id = %run.run_id, "slot already has a record");
                return false;
            }
            Err(e) => {
                tracing::error!(run_id = %run.run_id, error = %e, "cannot create run");
                return false;
            }
        }
        tracing::info!(run_id = %run.run_id, status = run.status.as_str(), "run created");
        if !run.status.is_terminal() {
            if let Some(at) = run.next_attempt_at.filter(|t| *t > now) {
                self.push_timer(at, Timer::RunDue { run_id: run.run_id.clone() });
            }
            self.runs.insert(run.run_id.clone(), run);
            self.try_dispatch().await;
        }
        true
    }

    /// Manual `TriggerTask`.
    pub(super) async fn trigger(&mut self, req: TriggerRequest) -> Result<(String, DateTime<Utc>, bool)> {
        let now = self.now();
        let e = self.tasks.get(&req.task_id).ok_or_else(|| Error::NotFound { kind: "task", id: req.task_id.clone() })?;
        let spec = &e.record.spec;
        let key = match &req.idempotency_key {
            Some(k) => {
                crate::model::task::validate_id("idempotency_key", k)?;
                k.clone()
            }
            None => uuid::Uuid::new_v4().simple().to_string(),
        };
        let run_id = manual_run_id(&req.task_id, &key);
        if req.delay_seconds > MAX_DELAY_SECONDS {
            return Err(Error::invalid("delay_seconds", format!("must be at most {MAX_DELAY_SECONDS} (1 year)")));
        }
        let at = req.not_before.unwrap_or_else(|| now + chrono::Duration::seconds(req.delay_seconds as i64));
        if at > now + chrono::Duration::seconds(MAX_DELAY_SECONDS as i64) {
            return Err(Error::invalid("not_before", "must be within 1 year from now"));
        }
        let mut run = RunRecord::pending(run_id.clone(), &req.task_id, &spec.agent_id, "manual", at, now);
        let mut params = spec.params();
        params.extend(req.params);
        run.params = params;
        run.priority = spec.execution.priority;
        if at > now {
            run.next_attempt_at = Some(at);
            run.pending_reason = Some(format!("delayed until {}", at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)));
        }
        let created = self.admit(run).await;
        if !created && self.store.get(&self.keys.run(&run_id)).await?.is_none() {
            return Err(Error::Store(format!("run {run_id} could not be created")));
        }
        Ok((run_id, at, created))
    }

    /// Assigns every due PENDING run that has a runner and concurrency room,
    /// highest priority first, then oldest slot.
    pub(super) fn try_dispatch(&mut self) -> futures::future::BoxFuture<'_, ()> {
        // Boxed: dispatch can end an attempt, which dispatches again.
        Box::pin(self.dispatch_due())
    }

    async fn dispatch_due(&mut self) {
        let now = self.now();
        let mut due: Vec<(i32, DateTime<Utc>, String)> = self
            .runs
            .values()
            .filter(|r| r.status == RunStatus::Pending && r.current_execution().is_none() && r.next_attempt_at.is_none_or(|t| t <= now))
            .map(|r| (-r.priority, r.scheduled_at, r.run_id.clone()))
            .collect();
        due.sort();
        for (_, _, run_id) in due {
            let Some(run) = self.runs.get(&run_id) else { continue };
            let Some(task) = self.tasks.get(&run.task_id) else {
                let mut run = run.clone();
                run.status = RunStatus::Cancelled;
                run.finished_at = Some(now);
                run.error = Some("task was deleted before the run started".into());
                self.save(run).await;
                continue;
            };
            let ex = &task.record.spec.execution;
            let limit = ex.concurrency_limit as usize;
            let in_flight = self.runs.values().filter(|r| r.task_id == run.task_id && r.current_execution().is_some()).count();
            let selector = ex.selector.as_ref().map(|s| s.labels.clone()).unwrap_or_default();
            let reason = if in_flight >= limit {
                Some(format!("queued behind {in_flight} running run(s) (concurrency_limit {limit})"))
            } else {
                let best = self
                    .runners
                    .values()
                    .filter(|r| r.can_take(&run.agent_id, &selector))
                    .max_by_key(|r| (r.free(), std::cmp::Reverse(r.runner_id.clone())));
                match best {
                    Some(r) => {
                        let runner_id = r.runner_id.clone();
                        self.assign(&run_id, &runner_id).await;
                        continue;
                    }
                    None if self.runners.values().any(|r| {
                        r.tx.is_some() && r.agents.contains(&run.agent_id) && selector.iter().all(|(k, v)| r.labels.get(k) == Some(v))
                    }) =>
                    {
                        Some(format!("waiting for a free slot on runners serving agent {:?}", run.agent_id))
                    }
                    None if !selector.is_empty() && self.runners.values().any(|r| r.tx.is_some() && r.agents.contains(&run.agent_id)) => {
                        Some(format!("no connected runner serving agent {:?} has the labels {selector:?}", run.agent_id))
                    }
                    None => Some(format!(
                        "no connected runner serves agent {:?}{}",
                        run.agent_id,
                        if selector.is_empty() { String::new() } else { format!(" with labels {selector:?}") }
                    )),
                }
            };
            if run.pending_reason != reason {
                let mut run = run.clone();
                run.pending_reason = reason;
                self.save(run).await;
            }
        }
    }

    fn context_json(&self, run: &RunRecord, execution_id: &str, attempt: u32) -> String {
        let mut ctx = self.tasks.get(&run.task_id).map(|t| t.record.spec.context.clone()).unwrap_or_default();
        ctx.insert("task_id".into(), run.task_id.clone().into());
        ctx.insert("run_id".into(), run.run_id.clone().into());
        ctx.insert("execution_id".into(), execution_id.into());
        ctx.insert("attempt".into(), attempt.into());
        ctx.insert("scheduled_at".into(), run.scheduled_at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true).into());
        ctx.insert("trigger".into(), run.trigger.clone().into());
        ctx.insert("params".into(), serde_json::Value::Object(run.params.clone()));
        ctx.insert("checkpoint".into(), run.progress.as_ref().and_then(|p| p.checkpoint.clone()).unwrap_or(serde_json::Value::Null));
        serde_json::Value::Object(ctx).to_string()
    }

    async fn assign(&mut self, run_id: &str, runner_id: &str) {
        let now = self.now();
        let Some(mut run) = self.runs.get(run_id).cloned() else { return };
        let timeout_s = self.tasks.get(&run.task_id).map_or(3600, |t| t.record.spec.execution.timeout_seconds.max(1));
        let execution_id = uuid::Uuid::new_v4().to_string();
        let attempt = run.attempts.len() as u32 + 1;
        run.attempts.push(Attempt {
            attempt,
            execution_id: execution_id.clone(),
            runner_id: runner_id.to_string(),
            runner_instance: self.runners.get(runner_id).map(|r| r.instance_id.clone()).unwrap_or_default(),
            dispatched_at: now,
            started_at: None,
            finished_at: None,
            outcome: None,
            error: None,
            exit_code: None,
        });
        run.dispatched_at = Some(now);
        run.pending_reason = None;
        run.next_attempt_at = None;
        let deadline = now.checked_add_signed(chrono::Duration::seconds(timeout_s)).unwrap_or(DateTime::<Utc>::MAX_UTC);
        let msg = ControlMessage {
            msg: Some(control_message::Msg::Assign(Assign {
                run_id: run.run_id.clone(),
                execution_id: execution_id.clone(),
                attempt,
                task_id: run.task_id.clone(),
                agent_id: run.agent_id.clone(),
                context_json: self.context_json(&run, &execution_id, attempt),
                checkpoint_json: run.progress.as_ref().and_then(|p| p.checkpoint.as_ref()).map(|c| c.to_string()).unwrap_or_default(),
                deadline: Some(pts(deadline)),
                timeout_seconds: timeout_s as u64,
                fencing_token: self.leadership.token,
                traceparent: String::new(),
                scheduled_at: Some(pts(run.scheduled_at)),
            })),
        };
        if !self.save(run).await {
            // Not recorded (fenced or store down): never send what is not stored.
            return;
        }
        let Some(runner) = self.runners.get_mut(runner_id) else { return };
        runner.running.insert(execution_id.clone(), run_id.to_string());
        let sent = match &runner.tx {
            Some(tx) => tx.send(msg).await.is_ok(),
            None => false,
        };
        let slack = chrono::Duration::from_std(self.timing.deadline_slack()).unwrap_or_default();
        self.push_timer(
            deadline.checked_add_signed(slack).unwrap_or(DateTime::<Utc>::MAX_UTC),
            Timer::Deadline { run_id: run_id.to_string(), execution_id: execution_id.clone() },
        );
        if sent {
            tracing::info!(run_id, runner_id, execution_id = %execution_id, attempt, "assigned");
        } else {
            if let Some(r) = self.runners.get_mut(runner_id) {
                r.tx = None;
            }
            self.end_attempt(
                run_id,
                &execution_id,
                AttemptEnd::simple(outcome::LOST, format!("runner {runner_id} stream closed before the assignment")),
            )
            .await;
        }
    }

    /// Ends the open attempt `execution_id` of a run and moves the run on:
    /// SUCCEEDED, CANCELLED, RETRYING (with backoff) or FAILED/TIMEOUT.
    pub(super) async fn end_attempt(&mut self, run_id: &str, execution_id: &str, end: AttemptEnd) {
        let now = self.now();
        for r in self.runners.values_mut() {
            r.running.remove(execution_id);
        }
        let Some(mut run) = self.runs.get(run_id).cloned() else { return };
        if run.current_execution() != Some(execution_id) {
            return;
        }
        let (max_retries, backoff_spec) = self
            .tasks
            .get(&run.task_id)
            .map(|t| (t.record.spec.execution.max_retries, t.record.spec.execution.retry_backoff))
            .unwrap_or((0, Default::default()));
        if let Some(a) = run.current_attempt_mut() {
            a.finished_at = Some(now);
            a.outcome = Some(end.outcome.to_string());
            a.error = end.error.clone();
            a.exit_code = end.exit_code;
        }
        run.error = end.error;
        if end.result.is_some() {
            run.result = end.result;
        }
        if let Some(s) = end.stdout_tail {
            run.stdout_tail = s;
        }
        if let Some(s) = end.stderr_tail {
            run.stderr_tail = s;
        }
        let attempts = run.attempts.len() as u32;
        match end.outcome {
            outcome::SUCCEEDED => {
                run.status = RunStatus::Succeeded;
                run.finished_at = Some(now);
            }
            outcome::CANCELLED => {
                run.status = RunStatus::Cancelled;
                run.finished_at = Some(now);
            }
            o if attempts <= max_retries => {
                let at = now.checked_add_signed(backoff(&backoff_spec, attempts)).unwrap_or(DateTime::<Utc>::MAX_UTC);
                run.status = RunStatus::Retrying;
                run.next_attempt_at = Some(at);
                tracing::info!(run_id, outcome = o, attempt = attempts, retry_at = %at, "attempt failed; retrying");
                self.push_timer(at, Timer::RunDue { run_id: run_id.to_string() });
            }
            o => {
                run.status = if o == outcome::TIMEOUT { RunStatus::Timeout } else { RunStatus::Failed };
                run.finished_at = Some(now);
            }
        }
        tracing::info!(run_id, status = run.status.as_str(), "attempt ended");
        self.save(run).await;
        self.try_dispatch().await;
    }

    /// A retry's backoff elapsed, or a delayed run's time came.
    pub(super) async fn on_run_due(&mut self, run_id: &str) {
        let now = self.now();
        let Some(run) = self.runs.get(run_id) else { return };
        if run.next_attempt_at.is_some_and(|t| t > now) {
            return;
        }
        if run.status == RunStatus::Retrying {
            let mut run = run.clone();
            run.status = RunStatus::Pending;
            run.next_attempt_at = None;
            self.save(run).await;
        }
        self.try_dispatch().await;
    }

    /// The control plane's own deadline for an attempt passed without a result.
    pub(super) async fn on_deadline(&mut self, run_id: &str, execution_id: &str) {
        let Some(run) = self.runs.get(run_id) else { return };
        if run.current_execution() != Some(execution_id) {
            return;
        }
        let runner_id = run.attempts.last().map(|a| a.runner_id.clone()).unwrap_or_default();
        self.send_cancel(&runner_id, run_id, execution_id, "deadline passed").await;
        let slack = self.timing.deadline_slack().as_secs();
        self.end_attempt(
            run_id,
            execution_id,
            AttemptEnd::simple(outcome::TIMEOUT, format!("{NO_RESULT} {runner_id} by {slack} s after the deadline")),
        )
        .await;
    }

    async fn send_cancel(&mut self, runner_id: &str, run_id: &str, execution_id: &str, reason: &str) {
        if let Some(tx) = self.runners.get(runner_id).and_then(|r| r.tx.clone()) {
            let msg = ControlMessage {
                msg: Some(control_message::Msg::Cancel(Cancel {
                    run_id: run_id.into(),
                    execution_id: execution_id.into(),
                    reason: reason.into(),
                })),
            };
            let _ = tx.send(msg).await;
        }
    }

    /// Cancels a run: PENDING/RETRYING at once, RUNNING by telling its runner.
    pub(super) async fn cancel_run(&mut self, run_id: &str, reason: &str) -> Result<RunRecord> {
        let now = self.now();
        let Some(mut run) = self.runs.get(run_id).cloned() else {
            return match self.store.get(&self.keys.run(run_id)).await? {
                Some(kv) => {
                    let run: RunRecord = serde_json::from_slice(&kv.value).map_err(|e| Error::Internal(e.to_string()))?;
                    Err(Error::FailedPrecondition(format!("run {run_id} is already {}", run.status.as_str())))
                }
                None => Err(Error::NotFound { kind: "run", id: run_id.to_string() }),
            };
        };
        if let Some(exec) = run.current_execution().map(str::to_string) {
            let runner_id = run.attempts.last().map(|a| a.runner_id.clone()).unwrap_or_default();
            self.send_cancel(&runner_id, run_id, &exec, reason).await;
            // The runner slot stays taken until the runner reports the
            // execution ended (its agent may take the kill grace to exit).
            if let Some(a) = run.current_attempt_mut() {
                a.finished_at = Some(now);
                a.outcome = Some(outcome::CANCELLED.into());
                a.error = Some(reason.to_string());
            }
        }
        run.status = RunStatus::Cancelled;
        run.finished_at = Some(now);
        run.next_attempt_at = None;
        run.pending_reason = None;
        run.error = Some(reason.to_string());
        self.save(run.clone()).await;
        tracing::info!(run_id, reason, "run cancelled");
        self.try_dispatch().await;
        Ok(run)
    }

    pub(super) async fn on_started(&mut self, s: Started) {
        let Some(mut run) = self.runs.get(&s.run_id).cloned() else { return };
        if run.current_execution() != Some(s.execution_id.as_str()) || run.attempts.last().is_some_and(|a| a.started_at.is_some()) {
            return;
        }
        let t = ts(s.started_at.as_ref()).unwrap_or_else(|| self.now());
        if let Some(a) = run.current_attempt_mut() {
            a.started_at = Some(t);
        }
        run.actual_started_at.get_or_insert(t);
        run.status = RunStatus::Running;
        self.save(run).await;
    }

    pub(super) async fn on_progress(&mut self, p: ProgressReport) {
        let now = self.now();
        let Some(mut run) = self.runs.get(&p.run_id).cloned() else { return };
        if run.current_execution() != Some(p.execution_id.as_str()) {
            return;
        }
        let checkpoint = parse_json(&p.checkpoint_json).or_else(|| run.progress.as_ref().and_then(|x| x.checkpoint.clone()));
        run.progress = Some(Progress { percent: p.percent, message: p.message, checkpoint, updated_at: now });
        self.save(run).await;
    }

    /// A runner reports an execution's end. Superseded executions are kept
    /// as evidence on their attempt and change nothing else. Returns once
    /// the report is stored (the caller then acks it).
    pub(super) async fn on_finished(&mut self, f: Finished) {
        let outcome = match Outcome::try_from(f.outcome).unwrap_or(Outcome::Unspecified) {
            Outcome::Succeeded => outcome::SUCCEEDED,
            Outcome::Timeout => outcome::TIMEOUT,
            Outcome::Cancelled => outcome::CANCELLED,
            Outcome::Failed | Outcome::Unspecified => outcome::FAILED,
        };
        // Whatever happens to the record, the execution no longer holds a runner slot.
        for r in self.runners.values_mut() {
            r.running.remove(&f.execution_id);
        }
        let current = self.runs.get(&f.run_id).is_some_and(|r| r.current_execution() == Some(f.execution_id.as_str()));
        // A runner that refused the assignment before starting it (slots
        // full, shutting down) did not run an attempt: the run waits again.
        if current && outcome == outcome::FAILED && REFUSALS.iter().any(|p| f.error.starts_with(p)) {
            let error = f.error.clone();
            self.requeue_unstarted(&f.run_id, &f.execution_id, |runner| format!("runner {runner} refused it: {error}")).await;
            return;
        }
        // Or the leader presumed this execution lost (its runner was silent
        // too long, e.g. across a failover) but it was the latest attempt and
        // no retry has started: the real outcome wins over the presumption.
        let revived = !current && self.revive_presumed_lost(&f).await;
        if current || revived {
            if revived {
                tracing::info!(run_id = %f.run_id, execution_id = %f.execution_id, outcome, "late report of an attempt presumed lost; recording its real outcome");
            }
            let end = AttemptEnd {
                outcome,
                error: (!f.error.is_empty()).then(|| f.error.clone()),
                exit_code: f.exit_code,
                result: parse_json(&f.result_json),
                stdout_tail: Some(f.stdout_tail),
                stderr_tail: Some(f.stderr_tail),
            };
            self.end_attempt(&f.run_id, &f.execution_id, end).await;
            return;
        }
        // Late report for a superseded or already-ended execution: evidence only.
        let mut run = match self.runs.get(&f.run_id) {
            Some(r) => r.clone(),
            None => match self.store.get(&self.keys.run(&f.run_id)).await {
                Ok(Some(kv)) => match serde_json::from_slice::<RunRecord>(&kv.value) {
                    Ok(r) => r,
                    Err(_) => return,
                },
                _ => return,
            },
        };
        let Some(a) = run.attempts.iter_mut().find(|a| a.execution_id == f.execution_id) else { return };
        if a.exit_code.is_some() || f.exit_code.is_none() {
            return;
        }
        a.exit_code = f.exit_code;
        if run.stdout_tail.is_empty() && run.stderr_tail.is_empty() {
            run.stdout_tail = f.stdout_tail.clone();
            run.stderr_tail = f.stderr_tail.clone();
        }
        let note = format!("late report from the runner: {outcome}");
        a.error = Some(match a.error.take() {
            Some(e) => format!("{e}; {note}"),
            None => note,
        });
        if run.status.is_terminal() {
            if let Err(e) = self.store_run(&mut run, false).await {
                tracing::warn!(run_id = %run.run_id, error = %e, "cannot record late report");
            }
        } else {
            self.save(run).await;
        }
    }
}

/// Writes a run record (and its `active/` index entry) in one transaction
/// guarded by the leader's fence. With `create`, only if the run does not
/// exist yet: `Ok(false)` means the slot is already taken (by another
/// replica, or by this leader before a failover). `extra` ops commit in the
/// same transaction (the scheduler's cursor). Sets `fencing_token` and
/// `updated_at` (UTC) on the record.
///
/// Errors: [`Error::Fenced`] when the fence fails (a newer leader exists);
/// store errors as they come.
pub async fn write_run(
    store: &dyn KvStore,
    keys: &Keys,
    leadership: &Leadership,
    now: DateTime<Utc>,
    run: &mut RunRecord,
    create: bool,
    extra: Vec<TxnOp>,
) -> Result<bool> {
    run.fencing_token = leadership.token;
    run.updated_at = now;
    let key = keys.run(&run.run_id);
    let value = serde_json::to_vec(&run).map_err(|e| Error::Internal(e.to_string()))?;
    let active = keys.active_run(&run.run_id);
    let index = if run.status.is_terminal() { TxnOp::delete(active) } else { TxnOp::put(active, Vec::new()) };
    let mut compares = leadership.fence.clone();
    if create {
        compares.push(Compare::absent(&key));
    }
    let mut success = vec![TxnOp::put(&key, value), index];
    success.extend(extra);
    let txn = Txn { compares, success, failure: vec![TxnOp::get(&key)] };
    let r = store.txn(txn).await?;
    if r.succeeded {
        return Ok(true);
    }
    // The failure branch read the run: present means the slot is taken; the
    // fence, if any, is checked again to tell the two apart.
    let fence_holds = match leadership.fence.first() {
        None => true,
        Some(c) => c.holds(store.get(&c.key).await?.as_ref()),
    };
    if create && fence_holds && r.gets.first().is_some_and(Option::is_some) {
        return Ok(false);
    }
    Err(Error::Fenced(format!("run {} not written: fencing token {} is stale", run.run_id, leadership.token)))
}
