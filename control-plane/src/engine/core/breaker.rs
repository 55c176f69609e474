//! Circuit breakers (`execution.circuit_breaker`): the core consults a
//! task's breaker when it admits a run and updates it when a run finishes;
//! the state machine itself is [`crate::model::breaker`].
//!
//! The breaker lives in the task's cursor, so it is written in the same
//! transaction as what changed it: the finished run that opened or closed
//! it (see `poll_effects`), or the slot record it skipped. A new leader
//! reads it back with the cursor.

use crate::clock::Now;

use super::{EngineCore, Reply, ReplyId};
use crate::engine::lifecycle::Lifecycle;
use crate::error::{Error, Result};
use crate::model::breaker::{Admission, Breaker, Change};
use crate::model::notification::NotifyEvent;
use crate::model::{Cursor, RunStatus};

impl EngineCore {
    /// What the task's breaker says about a new run now. `Allow` for a
    /// task without `circuit_breaker`.
    pub(super) fn breaker_admission(&self, now: Now, task_id: &str) -> Admission {
        let Some(e) = self.tasks.get(task_id) else { return Admission::Allow };
        if e.record.spec.execution.circuit_breaker.is_none() {
            return Admission::Allow;
        }
        e.cursor.as_ref().and_then(|c| c.breaker.as_ref()).map_or(Admission::Allow, |b| b.admission(now.wall))
    }

    /// The run admitted as the half-open trial was created.
    pub(super) fn breaker_trial_started(&mut self, now: Now, task_id: &str, run_id: &str) {
        let Some(mut b) = self.breaker_of(task_id) else { return };
        b.trial_started(run_id);
        tracing::info!(task_id, run_id, "circuit breaker half-open: trial run created");
        self.store_breaker(now, task_id, b, false);
    }

    /// A run of the task reached a terminal status: counts toward (or
    /// decides) its breaker. The run's write joins the cursor's group.
    pub(super) fn breaker_run_finished(&mut self, now: Now, task_id: &str, run_id: &str, status: RunStatus) {
        let Some(spec) = self.tasks.get(task_id).and_then(|e| e.record.spec.execution.circuit_breaker) else { return };
        let mut b = self.breaker_of(task_id).unwrap_or_default();
        let change = b.run_finished(&spec, run_id, status, now.wall);
        match change {
            Change::None => return,
            Change::Opened => tracing::warn!(
                task_id,
                run_id,
                failures = b.consecutive_failures,
                cooldown_seconds = spec.cooldown_seconds,
                opening = b.openings,
                "circuit breaker opened: runs are skipped until the cooldown ends"
            ),
            Change::Closed => tracing::info!(task_id, run_id, "circuit breaker closed: the trial run succeeded"),
            Change::TrialCancelled => tracing::info!(task_id, run_id, "circuit breaker trial cancelled; the next run is the trial"),
            Change::Counted => {}
        }
        self.with_cursor.insert(run_id.to_string());
        if change == Change::Opened {
            self.notify(now, run_id, NotifyEvent::OnBreakerOpen, Some(&b));
        }
        self.store_breaker(now, task_id, b, change == Change::Opened);
    }

    /// At load: a half-open breaker whose trial is not among the runs
    /// recovered (it finished without the breaker hearing, or was pruned)
    /// lets the next run be the trial.
    pub(super) fn recover_breakers(&mut self, now: Now) {
        let lost: Vec<(String, Breaker)> = self
            .tasks
            .iter()
            .filter_map(|(id, e)| {
                let b = e.cursor.as_ref()?.breaker.as_ref()?;
                let trial = b.trial_run_id.as_deref()?;
                self.runs.get(trial).is_none_or(|r| r.status.is_terminal()).then(|| (id.clone(), b.clone()))
            })
            .collect();
        for (task_id, mut b) in lost {
            tracing::warn!(task_id, trial = ?b.trial_run_id, "circuit breaker's trial run is not active; the next run is the trial");
            b.trial_lost();
            self.store_breaker(now, &task_id, b, false);
        }
    }

    /// `ResetBreaker`: closes the task's breaker by hand.
    pub(super) fn reset_breaker(&mut self, now: Now, reply: ReplyId, task_id: &str) {
        let r = self.reset_breaker_checked(now, task_id);
        self.fx.replies.push((reply, Reply::ResetBreaker(r)));
    }

    fn reset_breaker_checked(&mut self, now: Now, task_id: &str) -> Result<Breaker> {
        let e = self.tasks.get(task_id).filter(|e| !e.deleted).ok_or_else(|| Error::NotFound { kind: "task", id: task_id.to_string() })?;
        if e.record.spec.execution.circuit_breaker.is_none() {
            return Err(Error::FailedPrecondition(format!("task {task_id} has no execution.circuit_breaker")));
        }
        let mut b = self.breaker_of(task_id).unwrap_or_default();
        let was = b.phase;
        b.close();
        tracing::info!(task_id, was = was.as_str(), "circuit breaker reset by hand");
        self.store_breaker(now, task_id, b.clone(), false);
        Ok(b)
    }

    /// A definition without `circuit_breaker` forgets any breaker state.
    pub(super) fn drop_breaker_if_off(&mut self, now: Now, task_id: &str) {
        let Some(e) = self.tasks.get_mut(task_id) else { return };
        if e.record.spec.execution.circuit_breaker.is_some() {
            return;
        }
        let Some(cursor) = e.cursor.as_mut().filter(|c| c.breaker.is_some()) else { return };
        cursor.breaker = None;
        cursor.updated_at = Some(now.wall);
        let c = cursor.clone();
        self.cursors.insert(task_id.to_string(), Some(c));
    }

    fn breaker_of(&self, task_id: &str) -> Option<Breaker> {
        self.tasks.get(task_id)?.cursor.as_ref()?.breaker.clone()
    }

    /// Puts the breaker in the task's cursor (queued for this turn's
    /// write) and announces it.
    fn store_breaker(&mut self, now: Now, task_id: &str, b: Breaker, opened: bool) {
        let Some(e) = self.tasks.get_mut(task_id) else { return };
        let cursor = e.cursor.get_or_insert_with(Cursor::default);
        cursor.breaker = Some(b.clone());
        cursor.updated_at = Some(now.wall);
        let c = cursor.clone();
        self.cursors.insert(task_id.to_string(), Some(c));
        self.fx.events.push(Lifecycle::BreakerChanged { task_id: task_id.to_string(), breaker: b, opened });
    }
}
