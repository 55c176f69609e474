//! The one admission (issue 37): every source (`sources/`) hands its run
//! requests here. [`EngineCore::submit`] looks the task and the run id up
//! once — a task gone is `NotFound`, a run id already in memory is a
//! duplicate (create-if-absent: ids derive from the slot, the event, the
//! key) — and then either records the request's own SKIPPED reason
//! (`invalid_event`, `upstream_unmet`) or asks every policy
//! ([`EngineCore::admit`]: `paused`, breaker, overlap, resources,
//! budgets, ...). A skip leaves a SKIPPED record; consecutive skipped slots
//! of one reason are one record. A delayed run is recorded now and
//! admitted when due ([`EngineCore::admit_due`]) by the same policies.

use std::collections::HashSet;

use crate::clock::Now;

use super::policy::{Admit, AdmitQuery, Write};
use super::sources::{Input, RunRequest};
use super::{EngineCore, Urgency};
use crate::engine::lifecycle::Lifecycle;
use crate::error::{Error, Result};
use crate::model::notification::NotifyEvent;
use crate::model::run::{SkipReason, TriggerKind};
use crate::model::task::{MAX_PARAMS_BYTES, PRIORITY_RANGE, TaskSpec};
use crate::model::{RunRecord, RunStatus};

/// What the policies say of one run ([`EngineCore::decide`]).
enum Decision {
    Admitted { pending_reason: Option<String>, writes: Vec<Write>, charges: Vec<crate::model::budget::BudgetCharge> },
    Refused { reason: SkipReason, why: String, pause: bool },
}

/// What [`EngineCore::submit`] made of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Submitted {
    /// Its run id was in memory already: nothing made.
    Exists,
    /// A record was made: a run, or SKIPPED (its status says).
    Recorded,
}

impl EngineCore {
    /// The one entry of every run source: see the module docs.
    ///
    /// Errors: `NotFound` for a task that does not exist (or is deleted,
    /// unless the request settles a slot of an earlier definition);
    /// `InvalidArgument` (`params`) for a manual trigger's params that,
    /// merged with the task's, pass `MAX_PARAMS_BYTES`. Nothing is
    /// recorded then.
    pub(super) fn submit(&mut self, now: Now, req: RunRequest<'_>) -> Result<Submitted> {
        let RunRequest { mut run, input, priority_delta, def, batch, skip, delayed } = req;
        // A slot settled under an earlier definition was due before the
        // task changed: recorded even when that change was its deletion.
        let Some(e) = self.tasks.get(&run.task_id).filter(|e| !e.deleted || def.is_some()) else {
            return Err(Error::NotFound { kind: "task", id: run.task_id.clone() });
        };
        if self.runs.contains_key(&run.run_id) {
            return Ok(Submitted::Exists);
        }
        let current;
        let (def, paused) = match def {
            Some(d) => (&d.spec, d.paused),
            None => {
                current = e.record.spec.clone();
                (&current, e.record.paused)
            }
        };
        run.agent_id.clone_from(&def.agent_id);
        run.priority = def.execution.priority.saturating_add(priority_delta).clamp(*PRIORITY_RANGE.start(), *PRIORITY_RANGE.end());
        run.params = match input {
            Input::Task => def.params(),
            Input::Exact(p) => p,
            Input::Merged(extra) => {
                let mut params = def.params();
                params.extend(extra);
                let merged = crate::model::task::json_bytes(&serde_json::Value::Object(params.clone()));
                if merged > MAX_PARAMS_BYTES {
                    return Err(Error::invalid(
                        "params",
                        format!(
                            "merged with the task's context.params: {merged} bytes of JSON; at most {MAX_PARAMS_BYTES} (params are kept whole with every run)"
                        ),
                    ));
                }
                params
            }
        };
        if let Some((reason, why)) = skip {
            self.skip_one(now, &run, reason, why);
        } else if delayed {
            run.next_attempt_at = Some(run.scheduled_at);
            run.awaiting_admission = true;
            let at = run.scheduled_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
            run.pending_reason = Some(format!("delayed until {at}; admitted then"));
            self.create_awaiting(now, run);
        } else {
            let empty = HashSet::new();
            self.admit(now, run, def, paused, batch.unwrap_or(&empty));
        }
        Ok(Submitted::Recorded)
    }

    /// Asks every policy about `run` under `def`, paused or not (the task's active runs
    /// counted, listed only for `cancel_running`, the one policy that picks
    /// among them; live slots ignore a backfill's runs). `me`: runs not to
    /// count as overlap (a `run_all` catch-up's own, the run itself).
    /// Admitted: the runs `cancel_running` picks are cancelled, and the
    /// run's pending reason and what the policies reserve for it
    /// (charges apart, for its record) come back. Refused: the skip reason,
    /// why, and whether the task pauses too (the breaker).
    fn decide(&mut self, now: Now, run: &RunRecord, def: &TaskSpec, paused: bool, me: &HashSet<String>) -> Decision {
        let mut active = self.counts.active(&run.task_id, now.wall, me);
        if run.trigger != TriggerKind::Backfill {
            active = active.saturating_sub(self.counts.backfill_holders(&run.task_id));
        }
        let listed = if def.execution.overlap_policy == crate::model::task::OverlapPolicy::CancelRunning {
            self.counts.active_runs(&run.task_id, now.wall, me)
        } else {
            Vec::new()
        };
        let breaker = self.tasks.get(&run.task_id).and_then(|e| e.cursor.as_ref()?.breaker.clone());
        let q = AdmitQuery { now: now.wall, run, task: def, paused, active, active_runs: &listed, breaker: breaker.as_ref() };
        let pending_reason = match self.policies.admit(&q) {
            Admit::Pass => None,
            Admit::Waiting(reason) => Some(reason),
            Admit::AfterCancelling { cancel, reason, waiting } => {
                for old in cancel {
                    let _ = self.cancel(now, &old, &reason);
                }
                Some(waiting)
            }
            Admit::Skip { reason, why } => return Decision::Refused { reason, why, pause: false },
            Admit::SkipAndPause { reason, why } => return Decision::Refused { reason, why, pause: true },
        };
        let mut writes = self.policies.created(&q);
        let mut charges = Vec::new();
        writes.retain(|w| match w {
            Write::Charges(c) => {
                charges.extend(c.iter().cloned());
                false
            }
            _ => true,
        });
        Decision::Admitted { pending_reason, writes, charges }
    }

    /// The first decision point: a run asks to be created under `def` (the
    /// definition it is due under, `paused` its pause state; an earlier one
    /// while a change settles).
    /// The policies decide; a skip leaves a SKIPPED record. `batch`: runs
    /// of the same `run_all` catch-up, which the new run queues behind
    /// instead of counting them as overlap. Sources reach it through
    /// [`Self::submit`], which has looked the run id up.
    fn admit(&mut self, now: Now, mut run: RunRecord, def: &TaskSpec, paused: bool, batch: &HashSet<String>) {
        let (pending_reason, writes, charges) = match self.decide(now, &run, def, paused, batch) {
            Decision::Admitted { pending_reason, writes, charges } => (pending_reason, writes, charges),
            Decision::Refused { reason, why, pause } => {
                if pause {
                    self.fx.pauses.push((run.task_id.clone(), why.clone()));
                }
                self.skip_one(now, &run, reason, why);
                return;
            }
        };
        run.pending_reason = pending_reason;
        run.charges.extend(charges);
        let run_id = run.run_id.clone();
        tracing::debug!(run_id = %run_id, "run created");
        self.create(now, run);
        self.apply_writes(now, &run_id, writes);
        if let Some(r) = self.event_run(&run_id) {
            self.fx.events.push(Lifecycle::RunCreated(r));
        }
        self.make_ready(now, &run_id, false);
    }

    /// Records `run` (not yet created) as SKIPPED for `reason`: one slot —
    /// or, for a time slot skipped for the same reason as the task's
    /// latest record, one more slot of that record ([`Self::extend_skips`]).
    pub(super) fn skip_one(&mut self, now: Now, run: &RunRecord, reason: SkipReason, why: String) {
        let slot = run.scheduled_at;
        if run.trigger.is_slot() && self.extend_skips(now, run, reason, &why) {
            return;
        }
        let mut skipped =
            RunRecord::skipped(run.run_id.clone(), &run.task_id, &run.agent_id, run.trigger, reason, (1, slot, slot), why, now.wall);
        // What started it stays on the record (an event, the run it follows).
        skipped.event = run.event.clone();
        skipped.upstream = run.upstream.clone();
        skipped.params = run.params.clone();
        skipped.priority = run.priority;
        // A re-run or a backfill's run stays linked (and a re-run of a
        // follower is written alone, not with its long-ended upstream).
        skipped.rerun_of = run.rerun_of.clone();
        skipped.backfill_id = run.backfill_id.clone();
        skipped.fire_at = run.fire_at;
        let run_id = skipped.run_id.clone();
        self.create(now, skipped);
        if run.trigger.is_slot()
            && let (Some(e), Some(r)) = (self.tasks.get_mut(&run.task_id), self.runs.get(&run_id))
        {
            e.skips = Some(Box::new(r.clone()));
        }
        tracing::info!(run_id = %run_id, reason = reason.as_str(), "slot skipped");
        if let Some(r) = self.event_run(&run_id) {
            self.fx.events.push(Lifecycle::SlotSkipped { run: r, reason, count: 1, from: slot, until: slot });
        }
        self.notify(now, &run_id, NotifyEvent::OnSkipped, None);
    }

    /// Consecutive slots of a task skipped for one reason are one record
    /// (issue 34: a budget-exceeded 20-second task wrote a record per slot,
    /// ~120,000 by the month's end, pushing its real runs out of
    /// `keep_last`): the slot extends the task's latest record when that is
    /// a SKIPPED slot of the same reason and trigger — its count and range
    /// grow, its error is the latest why — rewritten in the task's group
    /// with the cursor. No notification for the extension (the record's
    /// first slot sent one). A new leader starts a new record. Returns
    /// false when there is no such record.
    fn extend_skips(&mut self, now: Now, run: &RunRecord, reason: SkipReason, why: &str) -> bool {
        let slot = run.scheduled_at;
        let Some(prev) = self.tasks.get_mut(&run.task_id).and_then(|e| e.skips.as_mut()) else { return false };
        if prev.skip_reason != Some(reason) || prev.trigger != run.trigger || prev.missed_until.is_some_and(|u| slot <= u) {
            return false;
        }
        prev.missed_count = Some(prev.missed_count.unwrap_or(1).saturating_add(1));
        prev.missed_until = Some(slot);
        prev.error = Some(why.to_string());
        prev.finished_at = Some(now.wall);
        let rec = (**prev).clone();
        let run_id = rec.run_id.clone();
        match self.runs.get_mut(&run_id) {
            // Created this turn, or not yet written: the write takes it as it is now.
            Some(r) => *r = rec,
            None => self.remember_run(rec),
        }
        self.touch(now, &run_id, Urgency::Now);
        self.writes.join_task(&run_id);
        tracing::debug!(run_id = %run_id, reason = reason.as_str(), %slot, "slot skipped (coalesced)");
        if let Some(r) = self.event_run(&run_id) {
            self.fx.events.push(Lifecycle::SlotSkipped { run: r, reason, count: 1, from: slot, until: slot });
        }
        true
    }

    /// A created run that never had an attempt ends SKIPPED for `reason`
    /// (a policy said so when it could be dispatched: a `skip` task's
    /// resource was busy then, a budget found it did not fit once it could
    /// estimate it). Its record says why, as a skip at admission does.
    pub(super) fn skip_pending(&mut self, now: Now, run_id: &str, reason: SkipReason, why: String) {
        let Some(run) = self.runs.get_mut(run_id) else { return };
        if run.status.is_terminal() || !run.attempts.is_empty() {
            return;
        }
        let slot = run.scheduled_at;
        let task_id = run.task_id.clone();
        run.status = RunStatus::Skipped;
        run.skip_reason = Some(reason);
        run.missed_count = Some(1);
        run.missed_from = Some(slot);
        run.missed_until = Some(slot);
        run.finished_at = Some(now.wall);
        run.error = Some(why);
        run.pending_reason = None;
        run.next_attempt_at = None;
        run.awaiting_admission = false;
        run.start_by = None;
        if let Some(e) = self.tasks.get_mut(&task_id) {
            e.skips = None;
        }
        self.ready.remove(run_id);
        self.timers.start_by.remove(&run_id.to_string());
        self.dispatch_needed = true;
        self.touch(now, run_id, Urgency::Now);
        tracing::info!(run_id, reason = reason.as_str(), "run skipped when it could go");
        if let Some(r) = self.event_run(run_id) {
            self.fx.events.push(Lifecycle::SlotSkipped { run: r, reason, count: 1, from: slot, until: slot });
        }
        self.notify(now, run_id, NotifyEvent::OnSkipped, None);
    }

    /// Records a run whose admission waits for its `next_attempt_at`
    /// (`awaiting_admission`): no policy is asked yet, nothing reserved.
    fn create_awaiting(&mut self, now: Now, run: RunRecord) {
        let run_id = run.run_id.clone();
        tracing::info!(run_id = %run_id, "run created; admitted when due");
        self.create(now, run);
        if let Some(r) = self.event_run(&run_id) {
            self.fx.events.push(Lifecycle::RunCreated(r));
        }
        self.make_ready(now, &run_id, false);
    }

    /// A delayed run is due: the policies decide it now, as they decide a
    /// slot ([`Self::admit`]) — it waits, it cancels the running ones, or
    /// it ends SKIPPED at its due time — and what they reserve is charged
    /// to it.
    pub(super) fn admit_due(&mut self, now: Now, run_id: &str) {
        let Some(run) = self.runs.get(run_id).cloned() else { return };
        let Some((def, paused)) = self.tasks.get(&run.task_id).filter(|e| !e.deleted).map(|e| (e.record.spec.clone(), e.record.paused))
        else {
            self.finish(now, run_id, RunStatus::Cancelled, "task deleted before the run was due".into());
            return;
        };
        let me: HashSet<String> = [run_id.to_string()].into();
        let (pending_reason, writes, charges) = match self.decide(now, &run, &def, paused, &me) {
            Decision::Admitted { pending_reason, writes, charges } => (pending_reason, writes, charges),
            Decision::Refused { reason, why, pause } => {
                if pause {
                    self.fx.pauses.push((run.task_id.clone(), why.clone()));
                }
                self.skip_pending(now, run_id, reason, why);
                return;
            }
        };
        let Some(r) = self.runs.get_mut(run_id) else { return };
        r.charges.extend(charges);
        r.awaiting_admission = false;
        r.next_attempt_at = None;
        r.pending_reason = pending_reason;
        self.touch(now, run_id, Urgency::Now);
        self.apply_writes(now, run_id, writes);
        self.make_ready(now, run_id, true);
    }
}
